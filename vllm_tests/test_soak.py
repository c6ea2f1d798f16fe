"""No false alarm: long seeded workloads on vLLM's own ``Scheduler``, nothing injected.

The workloads (``soak.py``, run once in its own process from the line's own test files,
with ``KVQUEUE_AUDIT_EVERY=1``, its results shared) run each seed's request stream three
ways: vLLM alone, then each twin under ``on_misuse="raise"``. Each way must run to its end
without an exception, kvqueue must count no repair, finding, refusal or stale index, and
the twins must schedule step for step what vLLM alone schedules (a digest of each step's
``SchedulerOutput``). ``SEEDS`` seeds of ``STEPS`` steps of arrivals each, then the steps
that run the requests left to their end.
"""

from __future__ import annotations

import warnings
from importlib.metadata import version
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("vllm")
pytest.importorskip("kvqueue.vllm")

import on_line

WORKLOADS = ("prefix", "preempt", "spec", "async", "connector", "sliding", "hybrid", "mamba")
# Sized for about 80 s of two busy cores on the newest line, all workloads (its budget: 3 min).
SEEDS = 4
STEPS = 350
KVQUEUE = ("cython", "python")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    home = tmp_path_factory.mktemp("hf-home")
    return on_line.run(
        "soak.py", [",".join(WORKLOADS), str(SEEDS), str(STEPS)], home, 900, KVQUEUE_AUDIT_EVERY="1"
    )


def runs(results: dict[str, Any], workload: str, seed: int) -> dict[str, Any]:
    if "unsupported" in results.get(workload, {}):
        pytest.skip(f"vLLM {version('vllm')}: {results[workload]['unsupported']}")
    return {way: results[f"{workload}/{seed}/{way}"] for way in ("vllm", *KVQUEUE)}


@pytest.mark.parametrize("seed", range(SEEDS))
@pytest.mark.parametrize("workload", WORKLOADS)
def test_vllm_alone_runs_the_workload_to_its_end(
    results: dict[str, Any], workload: str, seed: int
) -> None:
    run = runs(results, workload, seed)["vllm"]
    assert "raised" not in run
    assert run["unfinished"] == 0
    assert run["free"] == run["blocks"] - 1  # every block back but the null block
    assert len(run["steps"]) > STEPS
    if workload != "prefix":  # too few blocks for every request at once
        assert run["preempted"]
    assert bool(run["drafted"]) == (workload == "spec")
    assert run["hits"]  # prefix hits (the connector: tokens found outside)
    assert run["groups"] == (2 if workload in ("hybrid", "mamba") else 1)


@pytest.mark.parametrize("twin", KVQUEUE)
@pytest.mark.parametrize("seed", range(SEEDS))
@pytest.mark.parametrize("workload", WORKLOADS)
def test_kvqueue_reports_nothing_and_schedules_as_vllm_alone(
    results: dict[str, Any], workload: str, seed: int, twin: str
) -> None:
    ways = runs(results, workload, seed)
    run, alone = ways[twin], ways["vllm"]
    assert "raised" not in run
    assert run["repairs"] == {}
    assert run["findings"] == {}
    assert run["events"] == {}  # no refusal, repair, finding or stale index in the process
    assert run["audit_every"] == 1
    assert run["audited"] == len(run["steps"])  # every step audited, each a full read
    assert alone["audited"] == 0  # vLLM alone ran no audit: the comparison is with vLLM's
    # The first step that differs, then whether one run has steps the other has not.
    steps = zip(run["steps"], alone["steps"], strict=False)
    first = next((i for i, (mine, its) in enumerate(steps) if mine != its), None)
    assert first is None, f"step {first} scheduled otherwise than vLLM alone"
    assert len(run["steps"]) == len(alone["steps"])
    counts = ("free", "unfinished", "requests", "preempted", "drafted", "hits")
    assert {k: run[k] for k in counts} == {k: alone[k] for k in counts}
