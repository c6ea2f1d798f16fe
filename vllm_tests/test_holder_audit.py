"""The holder audit on vLLM's own ``Scheduler``: a block held by two requests, per contender.

Every line runs this (``run.py``'s LINE_TESTS). The scenario (``holder_scenario.py``) runs in
its own process from the line's own test files, whose ``create_scheduler`` builds the
scheduler; it is run once and its results shared. Forms: ``shared`` (a cached prefix block of
A and B freed once more, A aborted, C asks for every free block), ``single`` (a running
request's only reference freed by a connector-like caller), ``after_audit`` (freed by a
callback after the step's audit), each met at the free that releases the reference;
``unguarded`` and ``queued_held`` (queued by hand, with its count lowered or left), met as
they are queued.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("vllm")
pytest.importorskip("kvqueue.vllm")

import on_line

from support.helpers import one_line

# A guarded free, by a caller that is no manager of the pool, of a reference a live request
# holds: met at that free, before any count moves (after_audit: in a callback of the step
# after its audit, so the step raises under "raise").
FORMS = ("shared", "single")
EXIT_FORMS = ("after_audit",)
# A block queued by no guarded free while a live request lists it: met as it is queued.
ENTRY_FORMS = ("unguarded", "queued_held")
KVQUEUE = ("cython", "python")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    home = tmp_path_factory.mktemp("hf-home")
    return on_line.run(
        "holder_scenario.py", [",".join(FORMS + EXIT_FORMS + ENTRY_FORMS)], home, 600
    )


def over_held(run: dict[str, Any]) -> list[list[int]]:
    return [state["over_held"] for state in run["states"] if state["over_held"]]


@pytest.mark.parametrize("form", [*FORMS, *EXIT_FORMS, "unguarded"])
def test_vllm_alone_hands_the_block_to_a_second_request(results: dict[str, Any], form: str) -> None:
    run = results[f"{form}/vllm/-"]
    assert "raised" not in run
    assert run["c_has_block"]
    assert run["holder_has_block"]
    assert run["ref_cnt"] == 1  # two live requests list it
    assert [run["block"]] in over_held(run)


@pytest.mark.parametrize("twin", KVQUEUE)
@pytest.mark.parametrize("form", FORMS + EXIT_FORMS)
def test_raise_refuses_the_free_of_a_held_reference(
    results: dict[str, Any], form: str, twin: str
) -> None:
    run = results[f"{form}/{twin}/raise"]
    message = one_line(run["raised"] if form in EXIT_FORMS else run["refused"])
    said = f"HolderAuditError: BlockPool.free_blocks() would release block {run['block']}, "
    assert message.startswith(said)
    assert f"request '{run['holder']}' (FullAttentionManager)" in message
    assert "nothing was released" in message
    assert "holder_scenario.py" in message  # the call that made the fault, file and line
    if form in EXIT_FORMS:
        assert "retried" not in run  # the callback is gone: the step started again passes
    else:
        assert "raised" not in run  # nothing shared: the steps go on
        assert run["c_served"]
    assert not run["c_has_block"]
    assert run["holder_has_block"]
    assert not run["in_free_list"]
    assert run["ref_cnt"] == run["refs_before"] - (form == "shared")  # A's, at its abort
    assert not over_held(run)
    assert all(state["count_is_list"] for state in run["states"])


def test_vllm_alone_queues_a_held_block_free(results: dict[str, Any]) -> None:
    run = results["queued_held/vllm/-"]
    # C is handed the block its holder still lists, or vLLM's own assertion stops the step.
    assert run["c_has_block"] or "AssertionError" in run.get("raised", "")
    assert run["holder_has_block"]


# Met at the free (FORMS, EXIT_FORMS) or where the block would enter the free list
# (ENTRY_FORMS): the holder keeps it, every other block is handed out.
@pytest.mark.parametrize("twin", KVQUEUE)
@pytest.mark.parametrize("form", FORMS + EXIT_FORMS + ENTRY_FORMS)
def test_repair_keeps_the_block_with_its_holder(
    results: dict[str, Any], form: str, twin: str
) -> None:
    run = results[f"{form}/{twin}/repair"]
    assert "raised" not in run
    assert run["holder_has_block"]
    assert not run["c_has_block"]
    assert run["ref_cnt"] == 1
    assert not run["in_free_list"]
    # One of two holders' references freed leaves it one count short of its listings.
    assert run["repairs"] == {"under_counted" if form == "shared" else "listed_free": 1}
    assert not over_held(run)
    assert all(state["count_is_list"] for state in run["states"])
    assert run["c_served"]  # once the holder is done, C gets every block it asked for


@pytest.mark.parametrize("twin", KVQUEUE)
@pytest.mark.parametrize("form", ENTRY_FORMS)
def test_raise_refuses_the_call_that_would_queue_a_listed_block(
    results: dict[str, Any], form: str, twin: str
) -> None:
    run = results[f"{form}/{twin}/raise"]
    message = one_line(run["refused"])
    said = f"HolderAuditError: FreeKVCacheBlockQueue.append() would queue block {run['block']} "
    assert message.startswith(said)
    assert f"which request '{run['holder']}' (FullAttentionManager) lists" in message
    assert "holder_scenario.py" in message  # the call that made the fault, file and line
    assert "raised" not in run  # nothing shared: the steps go on
    assert not run["c_has_block"]
    assert run["holder_has_block"]
    assert not run["in_free_list"]
    assert run["ref_cnt"] == 1
    assert not over_held(run)
    assert all(state["count_is_list"] for state in run["states"])
    assert run["c_served"]
