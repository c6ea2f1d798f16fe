"""kvqueue in a live vLLM engine: ``vllm.LLM`` / ``AsyncLLM`` on the CPU, engine core in its own
process, a stub model with a real KV cache on the CPU (vllm_tests/live/).

Run with pytest in the vLLM venv (``make vllm-tests``); for an older line, with that line's
Python code first on ``PYTHONPATH`` (``PYTHONPATH=$(python vllm_tests/lines.py 0.31.0)``):
the engine cores the tests start import the vLLM this process imports. Each run is a fresh
driver process (``live.driver.run``) whose only kvqueue settings are ``KVQUEUE_VLLM`` and
``KVQUEUE_ON_MISUSE``, as a user's; what the engine core saw comes back in its journal
(``live.scheduler``). Every completion is checked against the stub model's own answer
(``live.model.completion``), which the engine gives only if no two requests held one KV block.
A run takes 30-60 s, so each is made once and shared by the tests that read it.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

# Importing vLLM imports torch, whose import-time DeprecationWarnings are not ours to fail on
# (the repository's pytest settings turn warnings into errors).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("vllm")
pytest.importorskip("kvqueue.vllm")

import vllm

# vllm_tests/ is on sys.path: pytest inserts a test file's directory (no __init__.py here).
from live import JOURNAL, driver, model

from kvqueue.vllm import _lines

from support.helpers import one_line

TWINS = {"cython": "kvqueue._queue", "python": "kvqueue._queue_py"}
#: KVQUEUE_VLLM for each twin: "1" is what a user sets, and picks the compiled twin.
SETTING = {"cython": "1", "python": "python"}
VLLM_POOL = os.path.join("vllm", "v1", "core", "block_pool.py")
#: The line of the vLLM under test: what its pool does with a double free differs.
LINE = _lines.find(vllm.__version__)
#: What a right engine answers, round by round (the driver's default workload).
RIGHT = driver.completions(3, 20, 24)
#: Form C needs a pool that fills up (a round's peak is about 120 blocks).
FULL_POOL = ("--blocks", "96")


class Runs:
    """Driver runs made on first use and kept for the session."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.done: dict[tuple[Any, ...], driver.Run] = {}

    def get(
        self,
        kvqueue: str | None,
        policy: str | None = None,
        inject: str | None = None,
        **kwargs: Any,
    ) -> driver.Run:
        key = (kvqueue, policy, inject, repr(sorted(kwargs.items(), key=str)))
        if key not in self.done:
            if "extra_env" in kwargs:
                kwargs["extra_env"] = dict(kwargs["extra_env"])
            self.done[key] = driver.run(self.work, kvqueue, policy, inject, **kwargs)
        return self.done[key]


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("live"))


def started(run: driver.Run) -> dict[str, Any]:
    (event,) = run.events("started")
    return event


def assert_served(run: driver.Run) -> None:
    """Every request served, and served right."""
    assert run.result["error"] is None, run.output[-3000:]
    assert run.completed == 60
    assert run.events("died") == []
    assert run.result["outputs"] == RIGHT


def wrong(run: driver.Run) -> int:
    """The completions the user got that the model would not have given."""
    return sum(
        got != want
        # strict=False: a dead engine leaves rounds unserved
        for got_round, want_round in zip(run.result["outputs"], RIGHT, strict=False)
        for got, want in zip(got_round, want_round, strict=True)
    )


# -- the engine as users start it ----------------------------------------------------------


def test_engine_core_is_its_own_spawned_process(runs: Runs) -> None:
    run = runs.get(None)
    assert_served(run)
    report = run.result["report"]
    assert report["pid"] == started(run)["pid"]  # the scheduler and the executor: one process
    assert report["pid"] != run.result["pid"]
    assert report["start_method"] == "spawn"
    assert started(run)["queue"] == "vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue"
    # The vLLM this process imported (an older line first on PYTHONPATH) is the engine's.
    assert started(run)["vllm"] == vllm.__version__


def test_the_models_answer_moves_with_every_token() -> None:
    """A KV slot that holds another request's token gives another answer."""
    prompt = driver.prompts(0, 1)[0]
    answer = model.next_token(prompt)
    for position in (0, len(prompt) // 2, len(prompt) - 1):
        changed = [*prompt]
        changed[position] = (changed[position] + 1) % model.VOCAB
        assert model.next_token(changed) != answer, position


def _step(worker: Any, new: list[Any], cached: list[tuple[str, int, int]]) -> list[list[int]]:
    """One scheduler step for the stub worker: new requests (id, prompt, blocks, computed),
    cached ones (id, computed, scheduled); its sampled tokens."""
    scheduled = {r.req_id: len(r.prompt_token_ids) - r.num_computed_tokens for r in new}
    scheduled.update({request_id: count for request_id, _, count in cached})
    output = worker.execute_model(
        SimpleNamespace(
            finished_req_ids=set(),
            scheduled_new_reqs=new,
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[c[0] for c in cached],
                new_block_ids=[None] * len(cached),
                resumed_req_ids=set(),
                num_computed_tokens=[c[1] for c in cached],
            ),
            num_scheduled_tokens=scheduled,
        )
    )
    return list(output.sampled_token_ids)


def test_the_stub_computes_from_its_kv_cache() -> None:
    """The stub worker's tokens come from what its cache holds: a prefix hit reads the blocks
    another request wrote, and a block written by a second holder changes the first's next
    token."""
    with warnings.catch_warnings():  # vLLM's executor modules import more of torch
        warnings.simplefilter("ignore", DeprecationWarning)
        from live.executor import StubWorker

    block = driver.BLOCK_SIZE
    config = SimpleNamespace(
        get_total_num_kv_heads=lambda: 4,
        get_head_size=lambda: 64,
        hf_text_config=SimpleNamespace(num_hidden_layers=2),
    )
    worker = StubWorker(
        SimpleNamespace(model_config=config, cache_config=SimpleNamespace(block_size=block))
    )
    worker.initialize_from_config([SimpleNamespace(num_blocks=8)])
    prompt = driver.prompts(0, 1)[0][: 2 * block + 3]  # two full blocks, three tokens more

    def new(request_id: str, tokens: list[int], blocks: list[int], computed: int) -> Any:
        return SimpleNamespace(
            req_id=request_id, prompt_token_ids=tokens, block_ids=(blocks,),
            num_computed_tokens=computed,
        )  # fmt: skip

    assert _step(worker, [new("a", prompt, [1, 2, 3], 0)], []) == [[model.next_token(prompt)]]
    # "b" hits a's two full blocks: it writes only its own tokens, in its own block 4.
    other = [*prompt[: 2 * block], 7, 8, 9, 10]
    assert _step(worker, [new("b", other, [1, 2, 4], 2 * block)], []) == [[model.next_token(other)]]
    # "c" is handed block 2 while "a" holds it (a double free's outcome) and writes it.
    intruder = driver.prompts(1, 1)[0][:block]
    _step(worker, [new("c", intruder, [2], 0)], [])
    tokens = [*prompt, model.next_token(prompt)]
    (got,) = _step(worker, [], [("a", len(prompt), 1)])
    assert got != [model.next_token(tokens)]
    assert got == [model.next_token(prompt[:block] + intruder + tokens[2 * block :])]


@pytest.mark.parametrize("twin", TWINS)
def test_the_engine_cores_pool_holds_kvqueues_queue(runs: Runs, twin: str) -> None:
    run = runs.get(SETTING[twin])
    assert_served(run)
    assert run.env == {"KVQUEUE_VLLM": SETTING[twin], JOURNAL: run.env[JOURNAL]}
    assert started(run)["queue"] == f"{TWINS[twin]}.FreeKVCacheBlockQueue"
    assert started(run)["installed"] == twin
    assert run.result["report"]["installed"] == twin


def vllms_own(methods: dict[str, str]) -> set[str]:
    """The pool methods whose code is still vLLM's (block_pool.py)."""
    return {name for name, path in methods.items() if path.endswith(VLLM_POOL)}


@pytest.mark.parametrize("twin", TWINS)
def test_the_engine_cores_pool_is_guarded(runs: Runs, twin: str) -> None:
    start = started(runs.get(SETTING[twin]))
    assert start["status"]["implementation"] == twin
    assert start["status"]["pool_guard"] is True
    assert start["status"]["on_misuse"] in (None, "raise")  # None: the environment's, unset
    assert start["on_misuse"] == "raise"
    assert vllms_own(start["methods"]) == set()
    assert set(start["methods"]) == set(start["status"]["guarded"])


def test_the_guard_can_be_turned_off(runs: Runs) -> None:
    run = runs.get("1", extra_env=(("KVQUEUE_POOL_GUARD", "0"),))
    assert_served(run)
    assert started(run)["status"]["pool_guard"] is False
    assert vllms_own(started(run)["methods"]) == set(started(run)["methods"])


def test_every_contender_serves_the_models_answers(runs: Runs) -> None:
    """No double free: vLLM alone and each twin give each request the model's completion."""
    for setting in (None, *SETTING.values()):
        run = runs.get(setting)
        assert_served(run)
        assert run.events("violation") == [], setting


def test_async_llm_asked_to_fork_spawns_and_serves_the_same(runs: Runs) -> None:
    """AsyncLLM with kvqueue; the fork asked for is overridden by vLLM's CPU platform."""
    run = runs.get(
        "1", args=("--api", "async"), extra_env=(("VLLM_WORKER_MULTIPROC_METHOD", "fork"),)
    )
    assert_served(run)
    assert run.result["report"]["start_method"] == "spawn"
    assert started(run)["queue"] == "kvqueue._queue.FreeKVCacheBlockQueue"


# -- injected double frees ------------------------------------------------------------------


@pytest.mark.parametrize("form", ["A", "B"])
def test_vllm_alone_serves_wrong_completions_or_dies(runs: Runs, form: str) -> None:
    """vLLM's own pool takes the block's ref_cnt to -1 and keeps it linked as free; the next
    round's prefix hit takes it (ref_cnt 0) while it stays in the free list, so it is handed
    out again while held: a completion comes out wrong, with no error, unless the engine core
    dies first at get_new_blocks' bare assert (the block popped at ref_cnt -1).

    vLLM 0.18-0.23 decrement every occurrence before they queue any, and queue a block only at 0:
    given twice (A), the block is at -1 and in no free list, lost to the pool, and nobody
    else is handed it."""
    run = runs.get(None, inject=form)
    (injected,) = run.events("injected")
    damage = run.events("violation")
    died = run.events("died")
    assert damage, run.output[-3000:]
    block = injected["block"]
    assert f"block {block}: ref_cnt -1, 0 holders" in damage[0]["found"]
    if form == "A" and LINE.counts_first:
        assert f"block {block}: held by none, not in the free list (lost)" in damage[0]["found"]
        assert_served(run)
        return
    assert wrong(run) or died, run.output[-3000:]
    if died:  # seen: AssertionError at block_pool.py's get_new_blocks
        assert died[0]["raised_at"].startswith(("block_pool.py:", "kv_cache_utils.py:"))
        assert run.result["error"] is not None


@pytest.mark.parametrize("twin", TWINS)
def test_repair_serves_every_request_and_keeps_the_pool_exact(runs: Runs, twin: str) -> None:
    run = runs.get(SETTING[twin], "repair", "AB", inject_count=2)
    assert_served(run)
    assert started(run)["on_misuse"] == "repair"
    injected = run.events("injected")
    assert sorted(event["form"] for event in injected) == ["A", "A", "B", "B"]
    assert run.events("violation") == [], run.events("violation")[:3]
    repaired = [e for e in run.events("log") if "repaired a double free" in e["message"]]
    assert len(repaired) >= 1
    assert sum(run.events("repairs")[-1]["counters"].values()) == len(injected)


# vLLM's prefix on each line it logs: the process, then the record's level, time and place. A
# message of several lines gets one per line, so a phrase that a line break cuts is read whole
# only without them.
_LOG_PREFIX = re.compile(
    r"^(?:\([^)\n]*pid=\d+\) )?(?:[A-Z]+ \d\d-\d\d \d\d:\d\d:\d\d \[[^\]\n]*\] ?)?",
    re.MULTILINE,
)


def logged_text(output: str) -> str:
    """``output`` without vLLM's log prefixes: what the records themselves say."""
    return _LOG_PREFIX.sub("", output)


@pytest.mark.parametrize(("form", "twin"), [("A", "cython"), ("B", "python")])
def test_raise_stops_at_the_faulty_free(runs: Runs, form: str, twin: str) -> None:
    run = runs.get(SETTING[twin], "raise", form)
    (injected,) = run.events("injected")
    (refused,) = run.events("refused")
    message = one_line(refused["message"])
    assert "double free" in message
    assert re.search(rf"\b{injected['block']}\b", message)
    assert "BlockPool.free_blocks()" in message
    assert refused["pool_after"] == []  # raised before anything changed
    assert run.events("violation") == []
    assert run.result["error"] is not None  # the engine core stopped on it, loudly
    assert "double free" in one_line(logged_text(run.output))
    assert wrong(run) == 0


# One twin each for forms C and D (both run A and B): an engine run costs 25-30 s, and the
# twins' sameness is what vLLM's suites, run three ways, prove.
@pytest.mark.parametrize("twin", ["python"])
def test_a_repair_never_stops_the_engine(runs: Runs, twin: str) -> None:
    """A held block linked into the free list of a full pool by a call of its own (no free):
    the free list's entry leaves it out, so the scheduler never counts it free, and the
    engine serves every request, each one right; the pool is exact at every check."""
    run = runs.get(SETTING[twin], "repair", "C", args=FULL_POOL)
    (injected,) = run.events("injected")
    assert injected["ref_cnt"] == 1
    assert injected["free_blocks"] == 0  # left out at the entry
    assert all(not v["found"] for v in run.events("violation")), run.events("violation")
    assert_served(run)
    counters = run.events("repairs")[-1]["counters"]
    assert counters.get("listed_free", 0) == 1, counters


# -- form D: a free that releases a reference its holder still lists ------------------------


def test_vllm_alone_gives_a_listed_block_to_another_request(runs: Runs) -> None:
    run = runs.get(None, inject="D")
    (injected,) = run.events("injected")
    block = injected["block"]
    found = [f for v in run.events("violation") for f in v["found"]]
    assert any(f.startswith(f"block {block}: ") for f in found), run.output[-3000:]
    assert wrong(run) or run.events("died"), run.output[-3000:]


def test_raise_stops_at_the_free_of_a_held_reference(runs: Runs) -> None:
    run = runs.get(SETTING["cython"], "raise", "D")
    (injected,) = run.events("injected")
    (died,) = run.events("died")
    assert died["type"] == "HolderAuditError"
    message = one_line(died["message"])
    assert f"BlockPool.free_blocks() would release block {injected['block']}, " in message
    assert f"request '{injected['request']}'" in message
    assert "live/scheduler.py" in message  # the call that made the fault, file and line
    assert "_audit.py" in died["raised_at"]
    assert wrong(run) == 0  # stopped before serving anything wrong
    assert run.result["error"] is not None


@pytest.mark.parametrize("twin", ["cython"])
def test_repair_keeps_the_block_with_its_holder(runs: Runs, twin: str) -> None:
    run = runs.get(SETTING[twin], "repair", "D")
    assert_served(run)
    counters = run.events("repairs")[-1]["counters"]
    found = (counters.get("listed_free", 0), counters.get("held_free", 0))
    assert found in ((1, 0), (0, 1)), counters
    logged = [e for e in run.events("log") if "released a held" in one_line(e["message"])]
    assert len(logged) == 1


def test_vllm_alone_hands_out_a_held_block(runs: Runs) -> None:
    """Form C without kvqueue: vLLM pops the held block and dies at its bare assert, or links
    it twice when its holder frees it."""
    run = runs.get(None, inject="C", args=FULL_POOL)
    (injected,) = run.events("injected")
    assert run.events("died") or wrong(run), run.output[-3000:]
    assert any(
        f"block {injected['block']}" in found
        for v in run.events("violation")
        for found in v["found"]
    )


def test_kvqueue_speaks_in_the_engine_cores_own_log(runs: Runs) -> None:
    """The active line and the repairs, in vLLM's format, from the engine core's process."""
    run = runs.get(SETTING["cython"], "repair", "AB", inject_count=2)
    prefix = r"\(EngineCore pid=\d+\) {} \d\d-\d\d \d\d:\d\d:\d\d \[{}:\d+\] "
    # kvqueue's module as vLLM's format names it: kvqueue/vllm/_plugin.py, or its name alone.
    module = r"(?:kvqueue/)?\w+\.py"
    active = prefix.format("INFO", module) + (
        r"kvqueue \S+ active on vLLM \S+: vLLM's free block queue is kvqueue's cython twin, "
        r"pool guard on \(.*\), holder audit on, on_misuse=repair"
    )
    repaired = prefix.format("WARNING", module) + (
        r"BlockPool\.(free_blocks|get_new_blocks|touch)\(\) repaired a double free"
    )
    # vLLM's format puts its prefix before each line of a record, kvqueue's lines at most 100
    # columns, the lines that continue one indented: each record one line again.
    any_prefix = re.compile(prefix.format(r"\w+", r"[^\]]+"))
    lines: list[str] = []
    for line in run.output.splitlines():
        found = any_prefix.match(line)
        if found and line[found.end() :].startswith("  ") and lines:
            lines[-1] += " " + line[found.end() :].strip()
        else:
            lines.append(line)
    assert any(re.search(active, line) for line in lines), run.output[-3000:]
    assert any(re.search(repaired, line) for line in lines), run.output[-3000:]
