"""What both harnesses share: the command line, fresh worker processes pinned to one CPU, the
machine a result was measured on, bootstrap intervals and the results file."""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import platform
import random
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from importlib import metadata
from pathlib import Path
from statistics import median
from typing import Any, NamedTuple

RESAMPLES = 5_000
#: A worker's environment variable: a directory whose kvqueue it imports ahead of the installed
#: one (another build, the baseline). A spawned process takes its parent's ``sys.path``, not
#: ``PYTHONPATH``: read here, which the harnesses import before anything imports kvqueue.
FIRST = "KVQUEUE_BENCH_FIRST"
if os.environ.get(FIRST):
    sys.path.insert(0, os.environ[FIRST])


def parser(doc: str, quick: str) -> argparse.ArgumentParser:
    """The options both harnesses take; ``quick`` is the help text of ``--quick``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--out", type=Path, help="results JSON (default: bench/results/...)")
    return p


def run(
    worker: Callable[[dict[str, Any]], dict[str, Any]], jobs: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``worker(job)`` of each job in turn, each in a fresh interpreter of its own (spawned: it
    draws its own memory layout and inherits nothing of this one, but ``job["env"]``, if any:
    environment variables set for it alone); its error stops the run."""
    records = []
    started = time.monotonic()
    # On a terminal the progress line rewrites itself; in a log, one line per job.
    end = "\r" if sys.stderr.isatty() else "\n"
    for done, job in enumerate(jobs, 1):
        saved = os.environ.copy()
        os.environ.update(job.get("env", {}))
        try:
            with ProcessPoolExecutor(1, multiprocessing.get_context("spawn")) as process:
                records.append(process.submit(worker, job).result())
        finally:
            os.environ.clear()
            os.environ.update(saved)
        elapsed = time.monotonic() - started
        eta = elapsed / done * (len(jobs) - done)
        line = f"[{done}/{len(jobs)}] {job['label']:<48} {elapsed:5.0f}s elapsed, ~{eta:4.0f}s left"
        print(line, end=end, file=sys.stderr, flush=True)
    if end == "\r":
        print(file=sys.stderr)
    return records


def pin() -> int | None:
    """Pin this process to the last CPU it may run on, if the OS allows; that CPU."""
    try:
        cpu = max(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
    except (AttributeError, OSError):  # no affinity calls on this OS, or not allowed
        return None
    return cpu


class Estimate(NamedTuple):
    median: float
    low: float
    high: float


def bootstrap_median(values: Sequence[float]) -> Estimate:
    """The median of ``values`` and a percentile-bootstrap 95% interval for it.

    The values are per-process results: the process, not the sample, is the unit that
    repeats (a process draws its own memory layout, CPU and neighbours' load).
    """
    rng = random.Random(0)
    medians = sorted(median(rng.choices(values, k=len(values))) for _ in range(RESAMPLES))
    low, high = medians[int(0.025 * RESAMPLES)], medians[int(0.975 * RESAMPLES) - 1]
    return Estimate(median(values), low, high)


def interval(estimate: Sequence[float] | None, digits: int = 3) -> str:
    """``median [low, high]``; n/a for no estimate."""
    if estimate is None:
        return "n/a"
    return "{:.{d}f} [{:.{d}f}, {:.{d}f}]".format(*estimate, d=digits)


def save(results: dict[str, Any], out: Path | None, kind: str) -> Path:
    """``results`` as JSON in ``out``, by default bench/results/<time>-<host>-``kind``.json."""
    name = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{platform.node()}-{kind}.json"
    out = out or Path(__file__).resolve().parent / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return out


def _output(*command: str) -> str:
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return ""
    return proc.stdout.strip()


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    # aarch64 kernels give only part numbers; lscpu knows their names (e.g. Neoverse-V2).
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    for line in lines + _output("lscpu").splitlines():
        if line.startswith(("model name", "cpu model", "Model name:")):
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
    package = Path(kvqueue.__file__).parent
    files = hashlib.sha256()
    for path in sorted(p for p in package.iterdir() if p.is_file()):
        files.update(path.name.encode() + path.read_bytes())
    return {
        "host": platform.node(), "machine": platform.machine(), "cpu": _cpu_model(),
        "cpus": os.cpu_count(), "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "python_build": " ".join(platform.python_build()),
        "cython": cython, "compiler": compiler,
        "cflags": sysconfig.get_config_var("CFLAGS") or "",
        "kvqueue": kvqueue.__version__, "kvqueue_implementation": kvqueue.IMPLEMENTATION,
        "kvqueue_path": str(package), "kvqueue_files": files.hexdigest()[:16],
        # The benchmark's own checkout: the kvqueue timed may be another build (the hash of
        # its files tells builds apart).
        "checkout": _output("git", "-C", here, "describe", "--always", "--dirty") or "unknown",
    }  # fmt: skip


def short(info: dict[str, Any]) -> str:
    """One line naming the host, for a table caption or a chart title."""
    # make bench builds kvqueue without isolation, with its venv's Cython: that one built it.
    cython = info["cython"]
    built = "a Cython not in this environment" if cython == "not installed" else f"Cython {cython}"
    return (
        f"{info['cpu']} ({info['machine']}, {info['cpus']} CPUs), {info['os']}; "
        f"{info['python_implementation']} {info['python']}; compiled twin built by {built} with "
        f"{info['compiler']}; kvqueue {info['kvqueue']} ({info['kvqueue_implementation']})"
    )
