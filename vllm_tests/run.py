"""vLLM's own tests, three ways: vLLM's queue, kvqueue's compiled twin, its pure twin.

vLLM is the release vllm_tests/vllm.env pins.

Run with the python of vllm_tests/venv.sh (``make vllm-tests``). vLLM's test files come from
its sdist (sdist.py), model ids resolve to configuration files only (hub.py), and pytest runs
once per queue with our plugin (kvqueue_plugin.py). Tests listed in vllm_tests/excluded.txt
(each with its reason) are left out. The run fails when the three sets of passing tests
differ, when a test not listed there fails with vLLM's own queue (the list is stale), or when
no test built a block pool.

``--quick`` runs the three suites every CI run takes; the default runs every suite that
builds a BlockPool or a Scheduler on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import hub
import sdist

VLLM_VERSION = sdist.VLLM_VERSION
HERE = Path(__file__).resolve().parent
QUICK = (
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_kv_cache_utils.py",
)
FULL = (
    "tests/v1/core",
    "tests/v1/kv_connector/unit",
    "tests/v1/simple_kv_offload",
    "tests/v1/kv_offload",
    "tests/v1/ec_connector/unit",
    "tests/v1/streaming_input/test_scheduler_streaming.py",
    "tests/v1/spec_decode/test_dflash_lookahead.py",
    "tests/v1/spec_decode/test_dynamic_sd.py",
    "tests/v1/engine/test_kv_cache_group_metadata.py",
    "tests/plugins_tests/test_scheduler_plugins.py",
)
TWINS = ("none", "cython", "python")


def excluded(path: Path) -> list[str]:
    """pytest arguments for excluded.txt: ``--deselect`` a node id, ``--ignore`` a path.

    Each line is ``ID_OR_PATH  # reason``; a line without a reason is refused (ValueError).
    """
    args = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        target, _, reason = line.partition("#")
        if not reason.strip():
            raise ValueError(f"{path}:{number}: no reason given for {target.strip()}")
        target = target.strip()
        args += ["--deselect", target] if "::" in target else ["--ignore", target]
    return args


def run_pytest(twin: str, root: Path, suites: tuple[str, ...], extra: list[str], work: Path):
    """One pytest run; its outcomes, {nodeid: {"outcome", "pools"}}. Raises on a crash."""
    report = work / f"report-{twin}.json"
    log = work / f"pytest-{twin}.log"
    report.unlink(missing_ok=True)
    env = dict(
        os.environ,
        PYTHONPATH=str(HERE),
        HF_HOME=str(work / "hf-home"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
    )
    command = [
        sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
        "-p", "kvqueue_plugin", f"--kvqueue={twin}", f"--kvqueue-report={report}",
        "--continue-on-collection-errors", "--tb=native",
        *extra, *suites,
    ]  # fmt: skip
    start = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        code = subprocess.run(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    # pytest's closing line; objects finalized at exit may print after it.
    closing = re.compile(r"\d+ (passed|failed).* in ")
    last = next((line for line in reversed(lines) if closing.search(line)), "?")
    print(f"[{twin}] {last} ({time.monotonic() - start:.0f} s; {log})", flush=True)
    if not report.is_file():
        raise RuntimeError(f"pytest exited {code.returncode} without a report; see {log}")
    return json.loads(report.read_text(encoding="utf-8"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the three seed suites only")
    parser.add_argument("--twins", default=",".join(TWINS), help="comma-separated subset")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    twins = tuple(args.twins.split(","))
    work = sdist.cache_dir() / f"vllm-{VLLM_VERSION}-runs"
    work.mkdir(parents=True, exist_ok=True)
    root = sdist.tests_root(VLLM_VERSION)
    hub.write(work / "hf-home")
    extra = excluded(HERE / "excluded.txt") + args.pytest_args
    suites = QUICK if args.quick else FULL
    results = {twin: run_pytest(twin, root, suites, extra, work) for twin in twins}

    problems = []
    passed = {
        twin: {name for name, entry in r.items() if entry["outcome"] == "passed"}
        for twin, r in results.items()
    }
    reference = twins[0]
    for twin in twins:
        counts = {}
        for entry in results[twin].values():
            counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
        pools = sum(1 for entry in results[twin].values() if entry["pools"])
        summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
        print(f"vllm-tests {twin:>6}: {summary}; {pools} tests built a BlockPool")
        if not pools:
            problems.append(f"{twin}: no test built a BlockPool")
        for name in sorted(passed[reference] ^ passed[twin]):
            where = reference if name in passed[reference] else twin
            problems.append(f"passes with {where} only: {name} ({results[twin].get(name)})")
    if "none" in results:
        for name, entry in sorted(results["none"].items()):
            if entry["outcome"] in ("failed", "error"):
                problems.append(f"fails with vLLM's own queue, not in excluded.txt: {name}")
    for problem in problems:
        print("vllm-tests: " + problem)
    verdict = "identical" if not problems else "DIFFERENT (or stale excluded.txt)"
    print(f"vllm-tests: pass sets across {', '.join(twins)}: {verdict}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
