"""Every repair kvqueue makes moves a counter of ``kvqueue.vllm._report`` (the one the metrics
write as ``kvqueue_*_total``), the queue's own repairs included: each repair path is driven here
and its counter checked, and a path this file does not know (a new place that logs a repair, a
new kind, a new method) fails it."""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from kvqueue import KVCacheBlock, _policy
from kvqueue.vllm import _audit, _index, _metrics, _pool_guard, _registry, _report

from support.fake_pool import guarded, line, make_pool, policy_of, screen_of
from support.helpers import bound_queue, one_line, raises_said

NEWEST = line("0.34")
SOURCES = Path(__file__).parents[1] / "src" / "kvqueue"

Event = tuple[str, str, str]


def _diff(before: dict[Event, int]) -> dict[Event, int]:
    after = _report.events()
    return {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}


# -- the queue's repairs -------------------------------------------------------------------------


def _stranger() -> Any:
    return KVCacheBlock(99, pool=object())


# (method, kind): the call that makes the queue repair it, given the twin, a repairing queue
# of four blocks of one pool, those blocks (1 to 3 free) and block 0 (taken).
QueueCall = Callable[[ModuleType, Any, list[Any], Any], object]
QUEUE_CALLS: dict[tuple[str, str], QueueCall] = {
    ("FreeKVCacheBlockQueue", "duplicate"): lambda mod, q, b, taken: mod.FreeKVCacheBlockQueue(
        [taken, taken], on_misuse="repair"
    ),
    ("FreeKVCacheBlockQueue", "linked"): lambda mod, q, b, taken: mod.FreeKVCacheBlockQueue(
        [taken, b[1]], on_misuse="repair"
    ),
    ("append", "linked"): lambda mod, q, b, taken: q.append(b[1]),
    ("append", "sentinel"): lambda mod, q, b, taken: q.append(q.fake_free_list_tail),
    ("append", "other_pool"): lambda mod, q, b, taken: q.append(_stranger()),
    ("append_n", "duplicate"): lambda mod, q, b, taken: q.append_n([taken, taken]),
    ("append_n", "linked"): lambda mod, q, b, taken: q.append_n([b[2]]),
    ("append_n", "sentinel"): lambda mod, q, b, taken: q.append_n([q.fake_free_list_head]),
    ("append_n", "other_pool"): lambda mod, q, b, taken: q.append_n([_stranger()]),
    ("prepend_n", "duplicate"): lambda mod, q, b, taken: q.prepend_n([taken, taken]),
    ("prepend_n", "linked"): lambda mod, q, b, taken: q.prepend_n([b[3]]),
    ("prepend_n", "sentinel"): lambda mod, q, b, taken: q.prepend_n([q.fake_free_list_tail]),
    ("prepend_n", "other_pool"): lambda mod, q, b, taken: q.prepend_n([_stranger()]),
    ("remove", "not_linked"): lambda mod, q, b, taken: q.remove(taken),
    ("remove", "other_pool"): lambda mod, q, b, taken: q.remove(_stranger()),
}


@pytest.mark.parametrize(("method", "kind"), list(QUEUE_CALLS), ids=[*map("-".join, QUEUE_CALLS)])
def test_each_repair_of_a_queue_moves_its_counter_once(
    queue_mod: ModuleType, method: str, kind: str, repair_log: pytest.LogCaptureFixture
) -> None:
    queue, blocks = bound_queue(queue_mod, 4, "repair")
    taken = queue.popleft()
    before = _report.events()
    QUEUE_CALLS[method, kind](queue_mod, queue, blocks, taken)
    assert _diff(before) == {("queue_repaired", method, kind): 1}
    (record,) = repair_log.records
    assert f"{method}() repaired a misuse ({kind} #1 on this queue)" in record.getMessage()


def test_a_repair_is_counted_when_the_log_is_past_its_limit(
    queue_mod: ModuleType, repair_log: pytest.LogCaptureFixture
) -> None:
    queue, blocks = bound_queue(queue_mod, 4, "repair")
    before = _report.events()
    for _ in range(50):
        queue.append(blocks[1])
    assert len(repair_log.records) < 50
    assert _diff(before) == {("queue_repaired", "append", "linked"): 50}


def test_a_refused_misuse_of_a_queue_moves_no_repair_counter(queue_mod: ModuleType) -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks, on_misuse="raise")
    before = _report.events()
    with raises_said(ValueError, "linked"):
        queue.append(blocks[1])
    assert _diff(before) == {}


# -- the pool guard's and the holder audit's repairs ---------------------------------------------


class KVCacheManager:
    def __init__(self, pool: Any, managers: int) -> None:
        single = []
        for _ in range(managers):
            each = type("FullAttentionManager", (), {})()
            each.req_to_blocks = defaultdict(list)
            single.append(each)
        self.coordinator = SimpleNamespace(block_pool=pool, single_type_managers=tuple(single))


def _double_free(pool: Any, method: str) -> None:
    (block,) = pool.get_new_blocks(1)
    if method == "unpin_blocks":
        pool.unpin_blocks([block, block], on_reuse=print)
    else:
        pool.free_blocks([block, block])


def _held_free(pool: Any, method: str) -> None:
    first, _ = pool.get_new_blocks(2)
    pool.free_block_queue.append(first)  # held, and in the free list
    if method == "unpin_blocks":
        pool.unpin_blocks([first], on_reuse=print)
    else:
        pool.free_blocks([first])


def _negative_touch(pool: Any) -> None:
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt = -1
    pool.touch([block])


def _listed(pool: Any, entry: bool = False) -> tuple[Any, Any]:
    """A manager of ``pool`` with its holder index (``entry``: and the free list's entry
    check), and a block its request ``A`` lists and holds."""
    manager = type("FullAttentionManager", (), {})()
    manager.req_to_blocks, manager.block_pool = defaultdict(list), pool
    _index.adopt(manager, _pool_guard.door if entry else None)
    manager.req_to_blocks["A"].extend(pool.get_new_blocks(1))
    (block,) = manager.req_to_blocks["A"]
    return manager, block


def _listed_in_alloc(pool: Any) -> None:
    """A block its holder lists, released by no guarded free, met at the free list's exit."""
    _, block = _listed(pool)
    block.ref_cnt -= 1
    pool.free_block_queue.prepend_n([block])
    pool.get_new_blocks(1)


def _entry(pool: Any, queue_mod: ModuleType, *, method: str, kind: str) -> None:
    """A block queued by hand while a live request lists it (released by no guarded free), or
    while it holds a reference, met at the free list's entry."""
    manager, block = _listed(pool, entry=True)
    if kind == "listed_free":
        block.ref_cnt -= 1
    else:
        del manager.req_to_blocks["A"]
    queue = pool.free_block_queue
    queue.append(block) if method == "append" else getattr(queue, method)([block])


def _released_listed(pool: Any, queue_mod: ModuleType, *, kind: str) -> None:
    """A guarded free of a reference the block's holder holds (``under_counted``: one of two
    holders' two references)."""
    manager, block = _listed(pool, entry=True)
    if kind == "under_counted":
        manager.req_to_blocks["B"].append(block)
        pool.touch([block])
    pool.free_blocks([block])


def _listed_touched(pool: Any) -> None:
    """A prefix hit on a block its holder lists, released by no guarded free."""
    _, block = _listed(pool)
    block.ref_cnt -= 1
    pool.free_block_queue.prepend_n([block])
    pool.touch([block])


def _held_in_alloc(pool: Any, refs: int) -> None:
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt = refs
    pool.free_block_queue.prepend_n([block])  # held, and first to be handed out
    pool.get_new_blocks(2)


def _audited(pool: Any, queue_mod: ModuleType, *, kind: str) -> None:
    manager = KVCacheManager(pool, managers=2)
    first, second = (m.req_to_blocks for m in manager.coordinator.single_type_managers)
    (block,) = pool.get_new_blocks(1)
    if kind == "listed_free":
        first["A"] = [block]
        block.ref_cnt = 0
        pool.free_block_queue.append(block)
    elif kind == "listed_twice":
        first["A"] = [block, block]
    elif kind == "two_managers":
        first["A"], second["A"] = [block], [block]
    else:
        first["A"], first["B"] = [block], [block]
    _audit.audit_holders(manager, screen_of(queue_mod), policy_of)


# (method, kind): the misuse that the guard on ``method`` repairs as ``kind``, on a pool.
GUARD_CALLS: dict[tuple[str, str], Callable[[Any, ModuleType], object]] = {
    ("free_blocks", "double_free"): lambda pool, mod: _double_free(pool, "free_blocks"),
    ("free_blocks", "held_free"): lambda pool, mod: _held_free(pool, "free_blocks"),
    ("free_blocks", "listed_free"): functools.partial(_released_listed, kind="listed_free"),
    ("free_blocks", "under_counted"): functools.partial(_released_listed, kind="under_counted"),
    ("unpin_blocks", "double_free"): lambda pool, mod: _double_free(pool, "unpin_blocks"),
    ("unpin_blocks", "held_free"): lambda pool, mod: _held_free(pool, "unpin_blocks"),
    ("touch", "negative_ref"): lambda pool, mod: _negative_touch(pool),
    ("touch", "listed_free"): lambda pool, mod: _listed_touched(pool),
    ("get_new_blocks", "held_free"): lambda pool, mod: _held_in_alloc(pool, 1),
    ("get_new_blocks", "negative_ref"): lambda pool, mod: _held_in_alloc(pool, -1),
    ("get_new_blocks", "listed_free"): lambda pool, mod: _listed_in_alloc(pool),
    **{
        (method, kind): functools.partial(_entry, method=method, kind=kind)
        for method, kinds in _registry.ENTRY.items()
        for kind in kinds
    },
    **{
        ("new_step_starts", kind): functools.partial(_audited, kind=kind)
        for kind in _policy.AUDIT_MISUSES
    },
}


@pytest.mark.parametrize(("method", "kind"), list(GUARD_CALLS), ids=[*map("-".join, GUARD_CALLS)])
def test_each_repair_of_the_guard_moves_its_counter_once(
    queue_mod: ModuleType, method: str, kind: str, repair_log: pytest.LogCaptureFixture
) -> None:
    with guarded(queue_mod, NEWEST) as cls:
        pool = make_pool(cls, queue_mod, 8, "repair")
        before = _report.events()
        GUARD_CALLS[method, kind](pool, queue_mod)
    moved = _diff(before)
    assert moved[("repaired", method, kind)] == 1
    # What vLLM's method does after the guard's repair may be the queue's to repair too (a
    # touch of a block whose negative count was taken as 0 removes it from the free list).
    repairs = {key: n for key, n in moved.items() if key[0] != "found"}
    others = repairs.keys() - {("repaired", method, kind)}
    assert all(outcome == "queue_repaired" for outcome, _, _ in others)
    assert len(repair_log.records) == sum(repairs.values())
    assert any(f"({kind} #1 on this pool)" in one_line(r.getMessage()) for r in repair_log.records)


def test_a_stale_holder_index_rebuilt_moves_its_counter_once(
    queue_mod: ModuleType, repair_log: pytest.LogCaptureFixture
) -> None:
    with guarded(queue_mod, NEWEST) as cls:
        pool = make_pool(cls, queue_mod, 8, "repair")
        manager = type("FullAttentionManager", (), {})()
        manager.req_to_blocks, manager.block_pool = defaultdict(list), pool
        _index.adopt(manager)
        manager.req_to_blocks["A"].extend(pool.get_new_blocks(1))
        dict.pop(manager.req_to_blocks, "A")  # through dict itself: the index not told
        coordinator = SimpleNamespace(block_pool=pool, single_type_managers=[manager])
        before = _report.events()
        _audit.audit_holders(
            SimpleNamespace(coordinator=coordinator), screen_of(queue_mod), policy_of
        )
    assert _diff(before) == {("rebuilt", "new_step_starts", "index_stale"): 1}
    assert len(repair_log.records) == 1
    assert "holder index was stale" in repair_log.records[0].getMessage()


# -- no repair this file does not drive ----------------------------------------------------------


def test_every_counter_an_engine_writes_is_driven_here() -> None:
    every = _metrics.combinations(list(_metrics._KINDS), True)
    repairs = {(method, kind) for outcome, method, kind in every if outcome == "repaired"}
    assert repairs == set(GUARD_CALLS)
    queue = {(method, kind) for outcome, method, kind in every if outcome == "queue_repaired"}
    assert queue == set(QUEUE_CALLS)
    assert {kind for _, kind in QUEUE_CALLS} == set(_policy.QUEUE_MISUSES)
    assert {kind for _, kind in GUARD_CALLS} == set(_policy.POOL_MISUSES)


# The functions that log a repair, each driven above: the queue's (both twins), the guard's
# notes, the holder audit's, the free list's entry and exit (a prefix hit's included), a
# free's release below its holders, the holder index's rebuild; _audit's log through its
# _logged. A repair logged anywhere else has no counter this file checks.
LOGGED_BY = {
    "_misuse",
    "log_notes",
    "_found",
    "enter",
    "hand_out",
    "touch_listed",
    "release",
    "_logged",
    "_rebuilt",
}
_LOGS = re.compile(
    r"_log\.(?:queue_)?repaired\(|(?<!def )\b_logged\(|\blogger\.\w+\([^)]*repaired", re.S
)


def test_every_place_that_logs_a_repair_is_driven_here() -> None:
    if not SOURCES.is_dir():
        pytest.skip("the suite runs outside the source tree (no src/ beside tests/)")
    found = set()
    for path in [*SOURCES.rglob("*.py"), *SOURCES.rglob("*.pyx")]:
        text = path.read_text()
        for match in _LOGS.finditer(text):
            defs = re.findall(r"^\s*(?:cdef [\w ]+?|def) (\w+)\(", text[: match.start()], re.M)
            found.add(defs[-1])
    assert found == LOGGED_BY
