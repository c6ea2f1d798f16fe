"""vllm-tests' reruns: which tests run again, and which then count as flaky (run.py)."""

from __future__ import annotations

from typing import Any

import run


def outcomes(**by_way: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {
        way: {name: {"outcome": outcome, "pools": 1} for name, outcome in tests.items()}
        for way, tests in by_way.items()
    }


def test_unsettled_is_what_compare_holds_against_the_line() -> None:
    results = outcomes(
        none={"same": "passed", "alone": "failed", "twin": "passed", "skips": "skipped"},
        cython={"same": "passed", "alone": "passed", "twin": "failed", "skips": "xfailed"},
        python={"same": "passed", "alone": "passed", "twin": "passed", "skips": "skipped"},
    )
    assert run.unsettled(results) == ["alone", "twin"]
    problems, _ = run.compare(results, "0.0.0")
    assert all(("alone" in p) or ("twin" in p) for p in problems)
    assert run.unsettled(outcomes(none={"x": "failed"}, cython={"x": "failed"})) == ["x"]


def test_settled_only_when_every_rerun_passes_every_way() -> None:
    results = outcomes(
        none={"flaky": "failed", "stays": "passed"},
        cython={"flaky": "passed", "stays": "failed"},
        python={"flaky": "passed", "stays": "passed"},
    )
    passed = {"flaky": "passed", "stays": "passed"}
    reruns = {
        "none": [outcomes(x=passed)["x"]] * 2,
        "cython": [outcomes(x=passed)["x"], outcomes(x={**passed, "stays": "failed"})["x"]],
        "python": [outcomes(x=passed)["x"]] * 2,
    }
    assert run.settle(results, reruns) == {"flaky": ["none"]}
    assert results["none"]["flaky"]["outcome"] == "passed"
    assert results["cython"]["stays"]["outcome"] == "failed"
    problems, _ = run.compare(results, "0.0.0")
    assert [p for p in problems if "flaky" in p] == []
    assert [p for p in problems if "stays" in p] != []


def test_a_test_missing_from_a_rerun_is_not_settled() -> None:
    results = outcomes(none={"gone": "failed"}, cython={"gone": "passed"})
    reruns = {"none": [{}, {}], "cython": [outcomes(x={"gone": "passed"})["x"]] * 2}
    assert run.settle(results, reruns) == {}
    assert results["none"]["gone"]["outcome"] == "failed"
