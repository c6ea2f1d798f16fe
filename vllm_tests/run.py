"""vLLM's own tests, three ways: vLLM's queue, kvqueue's compiled twin, its pure twin.

``--line 0.31`` (or ``0.31.0``) picks the vLLM line, one of ``kvqueue.vllm._lines.LINES``;
the default is the venv's own (the release vllm.env pins). Another line runs over the same
venv with its Python laid over the venv's vLLM (lines.py).

Run with the python of vllm_tests/venv.sh (``make vllm-tests``). vLLM's test files come from
that release's sdist (sdist.py), model ids resolve to configuration files only (hub.py), and
pytest runs once per queue with our plugin (kvqueue_plugin.py). Tests that
vllm_tests/excluded.txt lists for the line (each with its reason) are left out. The run fails
when the three sets of passing tests differ, when a test not listed there fails with vLLM's
own queue (the list is stale), when a listed path is not in the release, or when no test
built a block pool. A test that did not pass every way runs twice more each way, alone: when it
then passes every time it counts as passed and is named flaky (vLLM's long suites have timing,
and state across files); any other outcome leaves the first run's.

``--suites``: ``full`` (the venv's line's default) runs every suite that builds a BlockPool or
a Scheduler on the CPU (those the release has), ``core`` (an older line's default)
tests/v1/core, ``quick`` (``--quick``) three files of it. Then kvqueue's own tests run on the
line's vLLM (``--no-kvqueue-tests``: not; ``quick`` and an older line: all but the live
engines), and the run's counts go to its ``summary.json``, which ``--table`` prints for every
line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import hub
import lines
import sdist

from kvqueue.vllm._lines import LINES, Line, parse

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
# An older line's default: CI has not the time for each line's connector and offload suites
# (--suites full runs them, with exclusions still to be written for those lines).
CORE = ("tests/v1/core",)
SUITES = {"quick": QUICK, "core": CORE, "full": FULL}
TWINS = ("none", "cython", "python")
# A flake is one test or a few; more than this many is a difference to read, not to rerun.
RERUNS, MOST_RERUN = 2, 20
# kvqueue's own tests that an older line runs (vllm_tests/ whole on the venv's line): the
# double frees on its own BlockPool, the holder audit on its Scheduler, and the no-false-alarm
# soak on it (the workloads its test helpers build). The plugin's loading is the same code on
# every line (each line's install check: tests/test_vllm_dropin.py), and a probe of it costs a
# vLLM import.
LINE_TESTS = ("test_double_free.py", "test_holder_audit.py", "test_soak.py")


def in_scope(scope: str, line: Line) -> bool:
    """Whether an excluded.txt scope (``0.33``, ``0.23-0.26``, ``0.30-``) covers ``line``."""
    first, dash, last = scope.partition("-")
    low = parse(first + ".0")
    high = parse(last + ".0") if last else low if not dash else line.minor
    if low is None or high is None:
        raise ValueError(f"not a scope of lines: {scope!r}")
    return low <= line.minor <= high


def excluded(path: Path, line: Line) -> list[tuple[str, int]]:
    """excluded.txt's targets for ``line``: a node id or a path, with its line number.

    Each line is ``SCOPE  ID_OR_PATH  # reason``; a line without a reason or a scope is
    refused (ValueError).
    """
    targets = []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        entry, _, reason = text.partition("#")
        fields = entry.split()
        if not reason.strip() or len(fields) != 2:
            raise ValueError(f"{path}:{number}: not SCOPE TARGET # REASON: {text.strip()}")
        if in_scope(fields[0], line):
            targets.append((fields[1], number))
    return targets


def exclusion_args(targets: list[tuple[str, int]], root: Path) -> tuple[list[str], list[str]]:
    """pytest's ``--deselect`` (a node id) and ``--ignore`` (a path) for ``targets``, and the
    entries naming a file that the release does not have (stale)."""
    args, stale = [], []
    for target, number in targets:
        if not (root / target.partition("::")[0]).exists():
            stale.append(f"excluded.txt:{number}: {target} is not in this release")
        args += ["--deselect", target] if "::" in target else ["--ignore", target]
    return args, stale


def run_pytest(
    twin: str,
    root: Path,
    suites: list[str],
    extra: list[str],
    work: Path,
    path: list[Path],
    tag: str = "",
) -> dict[str, Any]:
    """One pytest run; its outcomes, {nodeid: {"outcome", "pools"}}. Raises on a crash.

    ``path``: what goes on PYTHONPATH (the line's overlay, if any, then our plugin); ``tag``
    names a rerun's report and log."""
    report = work / f"report-{twin}{tag}.json"
    log = work / f"pytest-{twin}{tag}.log"
    report.unlink(missing_ok=True)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(map(str, path)),
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
    output = log.read_text(encoding="utf-8", errors="replace").splitlines()
    # pytest's closing line; objects finalized at exit may print after it.
    closing = re.compile(r"\d+ (passed|failed).* in ")
    last = next((text for text in reversed(output) if closing.search(text)), "?")
    print(f"[{twin}{tag}] {last} ({time.monotonic() - start:.0f} s; {log})", flush=True)
    if not report.is_file():
        raise RuntimeError(f"pytest exited {code.returncode} without a report; see {log}")
    results: dict[str, Any] = json.loads(report.read_text(encoding="utf-8"))
    return results


def compare(results: dict[str, dict[str, Any]], release: str) -> tuple[list[str], dict[str, Any]]:
    """What differs between the twins' runs (problems), and each twin's counts by outcome."""
    problems = []
    twins = list(results)
    passed = {twin: passing(r) for twin, r in results.items()}
    counts: dict[str, Any] = {}
    for twin in twins:
        tally: dict[str, int] = {}
        for entry in results[twin].values():
            tally[entry["outcome"]] = tally.get(entry["outcome"], 0) + 1
        pools = sum(1 for entry in results[twin].values() if entry["pools"])
        audited = sum(1 for entry in results[twin].values() if entry.get("audits"))
        counts[twin] = {**tally, "pools": pools, "audited": audited}
        summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(tally.items()))
        print(
            f"vllm-tests {release} {twin:>6}: {summary}; {pools} tests built a BlockPool, "
            f"{audited} ran the holder audit"
        )
        if not pools:
            problems.append(f"{twin}: no test built a BlockPool")
        for name in sorted(passed[twins[0]] ^ passed[twin]):
            where = twins[0] if name in passed[twins[0]] else twin
            problems.append(f"passes with {where} only: {name} ({results[twin].get(name)})")
    for name, entry in sorted(results.get("none", {}).items()):
        if entry["outcome"] in ("failed", "error"):
            problems.append(f"fails with vLLM's own queue, not in excluded.txt: {name}")
    return problems, counts


def passing(run: dict[str, Any]) -> set[str]:
    """The tests that passed in one run's outcomes."""
    return {name for name, entry in run.items() if entry["outcome"] == "passed"}


def unsettled(results: dict[str, dict[str, Any]]) -> list[str]:
    """What :func:`compare` would hold against the line: the tests that passed some ways but
    not all, and those that failed with vLLM's own queue. Each is run again first."""
    passed = [passing(r) for r in results.values()]
    alone = results.get("none", {})
    failed = {name for name, entry in alone.items() if entry["outcome"] in ("failed", "error")}
    return sorted(set.union(*passed) - set.intersection(*passed) | failed)


def settle(
    results: dict[str, dict[str, Any]], reruns: dict[str, list[dict[str, Any]]]
) -> dict[str, list[str]]:
    """The unsettled tests that passed every way in every rerun: flaky in a long run (vLLM's own
    tests have timing and state across files), counted as passed in ``results``; {name: the
    ways it did not pass at first}. Any other outcome of a rerun leaves the first run's."""
    flaky = {}
    names = {name for runs in reruns.values() for run in runs for name in run}
    for name in sorted(names):
        again = [run.get(name, {}).get("outcome") for runs in reruns.values() for run in runs]
        if again and all(outcome == "passed" for outcome in again):
            flaky[name] = [
                twin for twin, r in results.items() if r.get(name, {}).get("outcome") != "passed"
            ]
            for r in results.values():
                if name in r:
                    r[name]["outcome"] = "passed"
    return flaky


def unmatched(
    targets: list[tuple[str, int]], suites: list[str], results: dict[str, Any], release: str
) -> list[str]:
    """The node ids of excluded.txt that left out no test of the suites run (stale for the
    line: its scope is too wide, or the test was renamed)."""
    deselected = [name for name, entry in results.items() if entry["outcome"] == "deselected"]
    stale = []
    for target, number in targets:
        path = target.partition("::")[0]
        ran = any(path == suite or path.startswith(suite.rstrip("/") + "/") for suite in suites)
        if "::" in target and ran and not any(name.startswith(target) for name in deselected):
            stale.append(f"excluded.txt:{number}: {target} names no test of vLLM {release}")
    return stale


def kvqueue_tests(release: str, overlay: Path | None, work: Path, quick: bool) -> dict[str, Any]:
    """kvqueue's own tests on the line's real vLLM: all of vllm_tests/ on the venv's line;
    on an older line, and with ``quick``, the double-free, holder and soak tests (the live
    engines take most of the full run's minutes; ``make demo`` runs one on any line).
    Their outcome, from pytest's JUnit XML."""
    whole = overlay is None and not quick
    files = ["vllm_tests"] if whole else [str(HERE / name) for name in LINE_TESTS]
    # The venv's line runs the live engines too: two test files at a time (pytest-xdist, each
    # file on one worker, so that its engine runs stay shared), on CI's two cores.
    spread = ["-n", "2", "--dist", "loadfile"] if whole else []
    xml = work / "vllm_tests.xml"
    xml.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(overlay or ""), VLLM_TARGET_DEVICE="cpu")
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:asyncio",
               "-rfEs", f"--junitxml={xml}", *spread, *files]  # fmt: skip
    start = time.monotonic()
    code = subprocess.run(command, cwd=HERE.parent, env=env).returncode
    outcome = {"exit": code, "seconds": round(time.monotonic() - start)}
    if xml.is_file():
        suite = ElementTree.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        outcome |= {
            key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")
        }
    print(f"vllm-tests {release}: kvqueue's tests: {outcome}")
    return outcome


def table() -> str:
    """A Markdown table of the last run of each line (``summary.json`` in its runs folder)."""
    rows = ["| line | release | suites | none | cython | python | same | vllm_tests/ | s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for each in LINES:
        path = sdist.cache_dir() / f"vllm-{each.release}-runs" / "summary.json"
        if not path.is_file():
            rows.append(f"| {each.name} | {each.release} | not run | | | | | | |")
            continue
        summary = json.loads(path.read_text(encoding="utf-8"))
        ways = []
        for twin in TWINS:
            c = summary["counts"].get(twin)
            ways.append(
                f"{c.get('passed', 0)}/{c.get('failed', 0) + c.get('error', 0)}/"
                f"{c.get('skipped', 0)}"
                if c
                else "not run"
            )
        k = summary.get("kvqueue_tests") or {}
        mine = (
            f"{k['tests'] - k['failures'] - k['errors'] - k['skipped']}/"
            f"{k['failures'] + k['errors']}/{k['skipped']}"
            if "tests" in k
            else "not run"
        )
        same = "yes" if not summary["problems"] else f"no ({len(summary['problems'])})"
        if flaky := summary.get("flaky"):
            same += f" ({len(flaky)} flaky)"
        seconds = summary["seconds"] + k.get("seconds", 0)
        rows.append(f"| {each.name} | {each.release} | {summary['suites']} | {' | '.join(ways)} "
                    f"| {same} | {mine} | {seconds} |")  # fmt: skip
    return "\n".join(rows) + "\n(passed/failed/skipped; vllm_tests/: kvqueue's own tests)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--line", help="the vLLM line: 0.31 or 0.31.0 (default: the venv's)")
    parser.add_argument(
        "--suites",
        choices=SUITES,
        help="quick: three files; core: tests/v1/core; full "
        "(default for the venv's own line; older lines: core)",
    )
    parser.add_argument("--quick", action="store_true", help="the same as --suites quick")
    parser.add_argument("--twins", default=",".join(TWINS), help="comma-separated subset")
    parser.add_argument("--jobs", type=int, default=1, help="pytest runs at once (default 1)")
    parser.add_argument(
        "--no-kvqueue-tests", action="store_true", help="vLLM's suites only, not vllm_tests/"
    )
    parser.add_argument("--table", action="store_true", help="print every line's last results")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    if args.table:
        print(table())
        return 0
    twins = tuple(args.twins.split(","))
    line = lines.line(args.line or lines.venv_release())
    overlay = lines.overlay(line)
    release = line.release
    print(f"vllm-tests: vLLM {release}" + (f" laid over the venv's ({overlay})" if overlay else ""))
    work = sdist.cache_dir() / f"vllm-{release}-runs"
    work.mkdir(parents=True, exist_ok=True)
    root = sdist.tests_root(release)
    hub.write(work / "hf-home")
    targets = excluded(HERE / "excluded.txt", line)
    exclusions, problems = exclusion_args(targets, root)
    extra = exclusions + args.pytest_args
    chosen = "quick" if args.quick else args.suites
    chosen = chosen or ("core" if overlay else "full")
    wanted = SUITES[chosen]
    suites = [suite for suite in wanted if (root / suite).exists()]
    if missing := sorted(set(wanted) - set(suites)):
        print(f"vllm-tests: vLLM {release} has no {', '.join(missing)}")
    path = [overlay, HERE] if overlay else [HERE]
    start = time.monotonic()
    # Each twin's pytest is its own process: --jobs 2 runs two at once (a 2-core CI machine).
    flaky = {}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = {t: pool.submit(run_pytest, t, root, suites, extra, work, path) for t in twins}
        results = {twin: run.result() for twin, run in runs.items()}
        suspects = unsettled(results)
        if 0 < len(suspects) <= MOST_RERUN:
            print(
                f"vllm-tests: {len(suspects)} tests did not pass every way; each runs {RERUNS} more"
            )
            tags = [f"-rerun{k}" for k in range(1, RERUNS + 1)]
            again = {
                t: [pool.submit(run_pytest, t, root, suspects, extra, work, path, k) for k in tags]
                for t in twins
            }
            flaky = settle(results, {t: [run.result() for run in r] for t, r in again.items()})
            for name, ways in flaky.items():
                print(f"vllm-tests: flaky, then passed every way {RERUNS} times: {name} ({ways})")
    seconds = round(time.monotonic() - start)
    found, counts = compare(results, release)
    problems += found + unmatched(targets, suites, results[twins[0]], release)
    for problem in problems:
        print("vllm-tests: " + problem)
    verdict = "identical" if not problems else "DIFFERENT (or stale excluded.txt)"
    print(f"vllm-tests {release}: pass sets across {', '.join(twins)}: {verdict} ({seconds} s)")
    quick = chosen == "quick"
    mine = None if args.no_kvqueue_tests else kvqueue_tests(release, overlay, work, quick)
    summary = {"release": release, "suites": chosen, "counts": counts, "problems": problems,
               "flaky": flaky, "seconds": seconds, "kvqueue_tests": mine}  # fmt: skip
    (work / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return 1 if problems or (mine and mine["exit"]) else 0


if __name__ == "__main__":
    sys.exit(main())
