"""What both harnesses share: the command line, fresh worker processes and their CPU pin, the
machine a result was measured on, bootstrap intervals and the results file.

Each harness is its own worker: ``run()`` starts ``script --worker JSON`` once per job and
reads one JSON object from the last line of its stdout; a failing worker stops the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from statistics import median
from typing import Any, NamedTuple

RESULTS = Path(__file__).resolve().parent / "results"
RESAMPLES = 5_000


def parser(doc: str, processes: str, quick: str) -> argparse.ArgumentParser:
    """The options both harnesses take; ``processes`` and ``quick`` are their help texts."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--processes", type=int, help=processes)
    p.add_argument("--cpu", type=int, help="pin workers to this CPU (default: the last allowed)")
    p.add_argument("--seed", type=int, default=0, help="seed of orders and shuffles")
    p.add_argument("--out", type=Path, help="results JSON (default: bench/results/...)")
    p.add_argument("--summarize", type=Path, metavar="JSON", help="re-tabulate a results file")
    return p


def run(
    script: str, jobs: list[dict[str, Any]], label: Callable[[dict[str, Any]], str]
) -> list[dict[str, Any]]:
    records = []
    started = time.monotonic()
    tty = sys.stderr.isatty()
    for done, job in enumerate(jobs, 1):
        proc = subprocess.run(
            [sys.executable, script, "--worker", json.dumps(job)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode:
            sys.stderr.write(proc.stderr[-5000:])
            raise SystemExit(f"worker failed on {label(job)}")
        records.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        elapsed = time.monotonic() - started
        eta = elapsed / done * (len(jobs) - done)
        line = (
            f"[{done:>4}/{len(jobs)}] {label(job):<48} {elapsed:5.0f}s elapsed, ~{eta:4.0f}s left"
        )
        print(f"\r{line}" if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
    if tty:
        print(file=sys.stderr)
    return records


def pin(cpu: int | None) -> int | None:
    """Pin this process to one CPU (the last allowed one unless told), if the OS allows."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    chosen = sorted(os.sched_getaffinity(0))[-1] if cpu is None else cpu
    try:
        os.sched_setaffinity(0, {chosen})
    except OSError:
        return None
    return chosen


class Estimate(NamedTuple):
    median: float
    low: float
    high: float


def bootstrap_median(values: Sequence[float]) -> Estimate:
    """The median of ``values`` and a percentile-bootstrap 95% interval for it.

    The values are per-process results: the process, not the sample, is the unit that
    repeats (a process draws its own memory layout, CPU and neighbours' load).
    """
    if not values:
        raise ValueError("no values")
    rng = random.Random(0)
    medians = sorted(median(rng.choices(values, k=len(values))) for _ in range(RESAMPLES))
    low, high = medians[int(0.025 * RESAMPLES)], medians[int(0.975 * RESAMPLES) - 1]
    return Estimate(median(values), low, high)


def interval(estimate: Sequence[float], digits: int = 3) -> str:
    """``median [low, high]``."""
    return "{:.{d}f} [{:.{d}f}, {:.{d}f}]".format(*estimate, d=digits)


def save(results: dict[str, Any], out: Path | None, name: str) -> Path:
    """``results`` as JSON in ``out``, by default bench/results/``name``.json."""
    out = out or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return out


def _output(*command: str) -> str:
    try:
        return subprocess.run(
            command, capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
    except OSError:
        return ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("model name", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    # aarch64 kernels give only part numbers; lscpu knows their names (e.g. Neoverse-V2).
    for line in _output("lscpu").splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe() -> dict[str, Any]:
    """What a result was measured on: host, interpreter, compiler, the kvqueue under test."""
    import kvqueue

    try:
        cython = metadata.version("Cython")
    except metadata.PackageNotFoundError:
        cython = "not installed"
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    compiler = _output(cc, "--version").partition("\n")[0] or f"{cc} (not found)"
    here = os.path.dirname(os.path.abspath(__file__))
    return {
        "host": platform.node(), "machine": platform.machine(), "cpu": _cpu_model(),
        "cpus": os.cpu_count(), "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "python_build": " ".join(platform.python_build()),
        "cython": cython, "compiler": compiler,
        "cflags": sysconfig.get_config_var("CFLAGS") or "",
        "kvqueue": kvqueue.__version__, "kvqueue_implementation": kvqueue.IMPLEMENTATION,
        "kvqueue_path": os.path.dirname(kvqueue.__file__),
        # The benchmark's own checkout: the kvqueue timed may be another build.
        "checkout": _output("git", "-C", here, "describe", "--always", "--dirty") or "unknown",
    }  # fmt: skip


def short(info: dict[str, Any]) -> str:
    """One line naming the host, for a table caption or a chart title."""
    # make bench builds kvqueue without isolation, with its venv's Cython: that one built it.
    cython = (
        "compiled twin built by a Cython not in this environment"
        if info["cython"] == "not installed"
        else f"compiled twin built by Cython {info['cython']}"
    )
    return (
        f"{info['cpu']} ({info['machine']}, {info['cpus']} CPUs), {info['os']}; "
        f"{info['python_implementation']} {info['python']}; {cython} with "
        f"{info['compiler']}; kvqueue {info['kvqueue']} ({info['kvqueue_implementation']})"
    )
