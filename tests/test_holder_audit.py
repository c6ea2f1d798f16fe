"""The holder audit: ``holder_faults`` (both screens) against an oracle that recounts the slow
way, and the rule (``_audit.audit_holders``) on a stand-in pool under both policies.

The real ``Scheduler`` of every line is vllm_tests/test_holder_audit.py's.
"""

from __future__ import annotations

import _thread
import random
import sys
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from kvqueue import _errors
from kvqueue.vllm import _audit, _report
from kvqueue.vllm._lines import LINES

from support.fake_pool import (
    consistent,
    guarded,
    make_pool,
    policy_of,
    pool_class,
    screen_of,
    state,
)
from support.helpers import one_line, raises_said

NEWEST = LINES[-1]


class Block:
    """A block whose fields live in an instance dict: the compiled screen reads them as the
    pure one does, with getattr."""

    def __init__(self, block_id: int, ref_cnt: int = 0, *, is_null: bool = False) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self.is_null = is_null
        self.prev_free_block: Any = None
        self.next_free_block: Any = None


class SlottedBlock:
    """Laid out as vLLM's @dataclass(slots=True) block: the compiled screen reads its slots."""

    __slots__ = ("block_id", "is_null", "next_free_block", "prev_free_block", "ref_cnt")
    __init__ = Block.__init__


@pytest.fixture(params=[Block, SlottedBlock], ids=["dict", "slots"])
def block_class(request: pytest.FixtureRequest) -> type:
    return request.param  # type: ignore[no-any-return]


def blocks_of(block_class: type, n: int) -> list[Any]:
    made = [block_class(i) for i in range(n)]
    made[0].is_null = True
    return made


def oracle(pool_blocks: list[Any], tables: list[dict[Any, list[Any]]]) -> list[tuple[str, Any]]:
    """What holder_faults must find, recounted listing by listing with plain containers."""
    found: list[tuple[str, Any]] = []
    reported: list[Any] = []
    listings: list[tuple[int, int, Any]] = []  # (manager, holder, block)
    holder = 0
    for group, table in enumerate(tables):
        for blocks in table.values():
            holder += 1
            listings += [(group, holder, b) for b in blocks]
    earlier: list[tuple[int, int, Any]] = []
    for group, who, block in listings:
        if block.is_null or not (0 <= block.block_id < len(pool_blocks)):
            continue
        if pool_blocks[block.block_id] is not block:
            continue
        mine = [(g, h) for g, h, b in earlier if b is block]
        earlier.append((group, who, block))
        if any(b is block for b in reported):
            continue
        kind = None
        if not mine:
            kind = "listed_free" if block.prev_free_block is not None else None
        elif who in {h for _, h in mine}:
            kind = "listed_twice"
        elif mine[0][0] != group:
            kind = "two_managers"
        if kind is None and type(block.ref_cnt) is not int:
            kind = "bad_count"
        elif kind is None and len(mine) + 1 > block.ref_cnt:
            kind = "under_counted"
        if kind is not None:
            reported.append(block)
            found.append((kind, block))
    return found


def test_a_sound_cache_has_nothing_to_report(screen: ModuleType, block_class: type) -> None:
    pool = blocks_of(block_class, 8)
    for block in pool[1:4]:
        block.ref_cnt = 2  # a cached prefix two requests share
    pool[4].ref_cnt = 3  # and a third holder that lists nothing (a connector's pin)
    pool[5].ref_cnt = 1
    table = {"A": [pool[0], pool[1], pool[2], pool[4]], "B": [pool[1], pool[2], pool[3]]}
    assert screen.holder_faults(pool, [table, {"A": [pool[0], pool[5]]}]) == []


@pytest.mark.parametrize(
    ("kind", "plant"),
    [
        ("listed_free", lambda p: setattr(p[2], "prev_free_block", p[1])),
        ("listed_twice", lambda p: None),
        ("two_managers", lambda p: None),
        ("under_counted", lambda p: setattr(p[3], "ref_cnt", 1)),
        ("bad_count", lambda p: setattr(p[2], "ref_cnt", 1.0)),
    ],
)
def test_each_fault_is_found_once(
    screen: ModuleType, block_class: type, kind: str, plant: Any
) -> None:
    pool = blocks_of(block_class, 6)
    for block in pool[1:]:
        block.ref_cnt = 2
    plant(pool)
    first = {"A": [pool[1], pool[2]], "B": [pool[3], pool[2]], "C": [pool[3]]}
    second: dict[str, list[Any]] = {}
    if kind == "listed_twice":
        first["A"].append(pool[1])
    if kind == "two_managers":
        second["A"] = [pool[4]]
        first["B"].append(pool[4])
    tables = [first, second]
    found = screen.holder_faults(pool, tables)
    assert found == oracle(pool, tables)
    assert [k for k, _ in found] == [kind]


def test_null_blocks_and_other_pools_blocks_are_not_counted(
    screen: ModuleType, block_class: type
) -> None:
    pool = blocks_of(block_class, 4)
    other = blocks_of(block_class, 4)
    other[1].prev_free_block = other[2]  # free in its own pool
    stray = block_class(99)
    table = {"A": [pool[0], pool[0], other[1], stray], "B": [pool[0]]}
    assert screen.holder_faults(pool, [table]) == []


@pytest.mark.parametrize("seed", range(40))
def test_seeded_caches_match_the_oracle(screen: ModuleType, block_class: type, seed: int) -> None:
    rng = random.Random(seed)
    pool = blocks_of(block_class, rng.randint(2, 40))
    for block in pool[1:]:
        block.ref_cnt = rng.choice([0, 1, 1, 2, 3, -1])
        if rng.random() < 0.1:
            block.prev_free_block = pool[0]
    tables: list[dict[Any, list[Any]]] = []
    for _ in range(rng.randint(1, 3)):
        table: dict[Any, list[Any]] = defaultdict(list)
        for request in range(rng.randint(0, 6)):
            table[request] = [rng.choice(pool) for _ in range(rng.randint(0, 8))]
        tables.append(table)
    assert screen.holder_faults(pool, tables) == oracle(pool, tables)


class Hostile:
    """A block whose ``is_null`` runs code: it empties its holder's list, audits again
    (the compiled screen then works in a table of its own), and drops the pool's blocks."""

    def __init__(self, block_id: int, victims: list[Any], screen: ModuleType) -> None:
        self.block_id = block_id
        self.ref_cnt = 1
        self.prev_free_block = None
        self.victims = victims
        self.screen = screen

    @property
    def is_null(self) -> bool:
        pool, listed = self.victims
        inner = self.screen.holder_faults(pool, [{"X": list(listed)}])
        assert all(kind != "bad_count" for kind, _ in inner)
        listed.clear()
        pool[:] = [None] * len(pool)
        return False


def test_code_a_block_runs_changes_nothing_it_already_read(
    screen: ModuleType, block_class: type
) -> None:
    pool = blocks_of(block_class, 6)
    for block in pool[1:]:
        block.ref_cnt = 1
    listed: list[Any] = [pool[1], pool[1]]
    hostile = Hostile(5, [pool, listed], screen)
    pool[5] = hostile
    table = {"A": listed, "B": [hostile, pool[2], pool[2]], "C": [pool[3]]}
    found = screen.holder_faults(pool, [table])
    # A lists block 1 twice; the hostile block then emptied A's list and the pool.
    assert [(kind, block.block_id) for kind, block in found] == [("listed_twice", 1)]
    assert listed == []


# -- the rule, on a stand-in pool ---------------------------------------------------------------


def manager_of(pool: Any, managers: int = 1, name: str = "FullAttentionManager") -> Any:
    kind = type(name, (), {})
    single = []
    for _ in range(managers):
        each = kind()
        each.block_pool = pool
        each.req_to_blocks = defaultdict(list)
        single.append(each)
    coordinator = SimpleNamespace(block_pool=pool, single_type_managers=tuple(single))
    return KVCacheManager(coordinator)


class KVCacheManager:
    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator


def shared_fault(queue_mod: ModuleType, policy: str) -> tuple[Any, Any, Any]:
    """Requests A and B share a block; it is freed once too often (A's count gone), so it
    is free while B lists it."""
    cls = pool_class(NEWEST)
    pool = make_pool(cls, queue_mod, 8, policy)
    manager = manager_of(pool)
    (table,) = [m.req_to_blocks for m in manager.coordinator.single_type_managers]
    a = pool.get_new_blocks(2)
    pool.touch(a[:1])
    table["A"] = list(a)
    table["B"] = [a[0]]
    pool.free_blocks([a[0]])  # a connector's extra free
    pool.free_blocks(table.pop("A")[::-1])  # A aborted
    return pool, manager, a[0]


def test_raise_names_the_block_and_its_holder_and_changes_nothing(
    queue_mod: ModuleType,
) -> None:
    pool, manager, block = shared_fault(queue_mod, "raise")
    before = state(pool)
    findings = _report.audit_findings()
    with pytest.raises(_errors.HolderAuditError) as caught:
        _audit.audit_holders(manager, screen_of(queue_mod), policy_of)
    message = one_line(caught.value)
    assert f"block {block.block_id} is in the free list (ref_cnt 0)" in message
    assert "request 'B' (FullAttentionManager)" in message
    assert "Nothing was changed" in message
    assert "Pool: BlockPool at" in message
    assert state(pool) == before
    assert _report.audit_findings()["listed_free"] == findings["listed_free"] + 1


def test_raise_names_the_guarded_free_that_released_the_block(queue_mod: ModuleType) -> None:
    """The call that last took the block's count to 0, as the guard saw it (a pool without a
    holder index: the audit reads its frees): file and line."""
    with guarded(queue_mod, NEWEST) as cls:
        pool = make_pool(cls, queue_mod, 8, "raise")
        manager = manager_of(pool)
        (table,) = [m.req_to_blocks for m in manager.coordinator.single_type_managers]
        a = pool.get_new_blocks(2)
        pool.touch(a[:1])
        table["A"], table["B"] = list(a), [a[0]]
        pool.free_blocks([a[0]])
        line = sys._getframe().f_lineno + 1
        pool.free_blocks(table.pop("A")[::-1])
        with pytest.raises(_errors.HolderAuditError) as caught:
            _audit.audit_holders(manager, screen_of(queue_mod), policy_of)
    said = one_line(caught.value)
    released = said.split("no holder index checked was a free called from ")[1]
    site = f"tests/test_holder_audit.py:{line} in test_raise_names_the_guarded_free_that"
    assert released.split(". ")[0].endswith(site + "_released_the_block")


def test_a_free_no_python_code_called_is_kept_from_an_unknown_site(queue_mod: ModuleType) -> None:
    """A guarded free that is a thread's own target has no caller above kvqueue's frames."""
    with guarded(queue_mod, NEWEST) as cls:
        pool = make_pool(cls, queue_mod, 8, "raise")
        queue = pool.free_block_queue
        free = queue.num_free_blocks
        taken = pool.get_new_blocks(2)
        _thread.start_new_thread(pool.free_blocks, (taken,))
        deadline = time.monotonic() + 10
        while queue.num_free_blocks < free and time.monotonic() < deadline:
            time.sleep(0.01)
        assert queue.num_free_blocks == free
    assert _report.last_freed(taken[0]) == "unknown"


def test_repair_keeps_the_block_with_its_holder(queue_mod: ModuleType, repair_log: Any) -> None:
    pool, manager, block = shared_fault(queue_mod, "repair")
    _audit.audit_holders(manager, screen_of(queue_mod), policy_of)
    assert block.ref_cnt == 1
    assert block.prev_free_block is None
    consistent(pool)
    assert _report.pool_repairs(pool)["listed_free"] == 1
    (record,) = repair_log.records
    said = " ".join(record.message.split())  # the record's lines, one line again
    assert "holder audit repaired a shared block (listed_free #1 on this pool)" in said
    assert "taken out of the free list, ref_cnt 0 -> 1" in said
    # Nothing left to find: a second audit is silent.
    _audit.audit_holders(manager, screen_of(queue_mod), policy_of)
    assert _report.pool_repairs(pool)["listed_free"] == 1


def test_repair_raises_a_count_to_its_holders(queue_mod: ModuleType) -> None:
    pool = make_pool(pool_class(NEWEST), queue_mod, 8, "repair")
    manager = manager_of(pool, managers=2)
    first, second = (m.req_to_blocks for m in manager.coordinator.single_type_managers)
    (block,) = pool.get_new_blocks(1)
    first["A"] = [block]
    second["A"] = [block]  # one block in two managers (vLLM issue 43884)
    _audit.audit_holders(manager, screen_of(queue_mod), policy_of)
    assert block.ref_cnt == 2
    assert _report.pool_repairs(pool)["two_managers"] == 1
    consistent(pool)


@pytest.mark.parametrize("policy", ["raise", "repair"])
def test_a_count_that_is_no_integer_is_refused_under_either_policy(
    queue_mod: ModuleType, policy: str
) -> None:
    pool = make_pool(pool_class(NEWEST), queue_mod, 8, policy)
    manager = manager_of(pool)
    (block,) = pool.get_new_blocks(1)
    manager.coordinator.single_type_managers[0].req_to_blocks["A"] = [block]
    block.ref_cnt = "1"
    before = state(pool)
    with raises_said(TypeError, "ref_cnt of str '1', not an integer"):
        _audit.audit_holders(manager, screen_of(queue_mod), policy_of)
    assert state(pool) == before


@pytest.mark.parametrize("name", ["HiSparseResidentManager", "HiSparseHotManager"])
def test_hisparse_unpinned_pages_are_not_reported(queue_mod: ModuleType, name: str) -> None:
    pool = make_pool(pool_class(NEWEST), queue_mod, 8, "raise")
    manager = manager_of(pool, name=name)
    (block,) = pool.get_new_blocks(1)
    manager.coordinator.single_type_managers[0].req_to_blocks["A"] = [block]
    pool.unpin_blocks([block], lambda b: None)  # read on, counted free: on purpose
    assert block.prev_free_block is not None
    _audit.audit_holders(manager, screen_of(queue_mod), policy_of)


@pytest.mark.parametrize("seed", range(20))
def test_only_the_freed_blocks_are_read_between_full_audits(
    screen: ModuleType, block_class: type, seed: int
) -> None:
    rng = random.Random(seed)
    pool = blocks_of(block_class, 30)
    for block in pool[1:]:
        block.ref_cnt = rng.choice([0, 1, 2])
    table = {r: [rng.choice(pool) for _ in range(6)] for r in range(5)}
    only = [rng.sample(pool, 4), rng.sample(pool, 3)]
    wanted = {id(b) for batch in only for b in batch}
    restricted = {r: [b for b in blocks if id(b) in wanted] for r, blocks in table.items()}
    assert screen.holder_faults(pool, [table], only) == oracle(pool, [restricted])


def audited_pool(queue_mod: ModuleType, policy: str) -> Iterator[tuple[Any, Any]]:
    with guarded(queue_mod, NEWEST) as cls:
        pool = make_pool(cls, queue_mod, 16, policy)
        yield pool, manager_of(pool, managers=2)


@pytest.fixture
def audited(queue_mod: ModuleType) -> Iterator[tuple[Any, Any]]:
    yield from audited_pool(queue_mod, "repair")


def step(queue_mod: ModuleType, manager: Any, every: int) -> None:
    _audit.audit_holders(manager, screen_of(queue_mod), policy_of, every)


def test_a_guarded_free_of_a_held_block_is_found_at_the_next_step(
    queue_mod: ModuleType, audited: tuple[Any, Any]
) -> None:
    pool, manager = audited
    table = manager.coordinator.single_type_managers[0].req_to_blocks
    step(queue_mod, manager, 64)  # the first audit of a manager reads everything
    table["A"] = pool.get_new_blocks(3)
    step(queue_mod, manager, 64)  # nothing freed: nothing read
    pool.free_blocks(table["A"][1:2])  # a connector frees A's only reference
    step(queue_mod, manager, 64)
    assert _report.pool_repairs(pool)["listed_free"] == 1
    consistent(pool)


def test_a_listing_made_without_a_reference_waits_for_the_full_audit(
    queue_mod: ModuleType, audited: tuple[Any, Any]
) -> None:
    pool, manager = audited
    first, second = (m.req_to_blocks for m in manager.coordinator.single_type_managers)
    step(queue_mod, manager, 4)
    first["A"] = pool.get_new_blocks(2)
    second["A"] = first["A"][:1]  # listed by two managers, one reference: no free shows it
    for _ in range(3):
        step(queue_mod, manager, 4)
        assert _report.pool_repairs(pool)["two_managers"] == 0
    step(queue_mod, manager, 4)  # the fourth step since the last full audit
    assert _report.pool_repairs(pool)["two_managers"] == 1
    consistent(pool)


class _Unnamed:
    """A manager no weak reference can name: no place is kept for it."""

    __slots__ = ("coordinator",)

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator


def test_a_manager_no_weak_reference_names_is_read_whole_at_each_step(
    queue_mod: ModuleType, audited: tuple[Any, Any]
) -> None:
    pool, manager = audited
    unnamed = _Unnamed(manager.coordinator)
    first, second = (m.req_to_blocks for m in manager.coordinator.single_type_managers)
    step(queue_mod, unnamed, 0)
    first["A"] = pool.get_new_blocks(2)
    second["A"] = first["A"][:1]  # listed by two managers: no free shows it
    step(queue_mod, unnamed, 0)  # never a full read by the setting, yet one each time
    assert _report.pool_repairs(pool)["two_managers"] == 1
    assert all(entry[0]() is not unnamed for entry in _audit.PLACES.values())


class _Named:
    """A manager a weak reference names, with nothing else."""


def test_the_step_guard_reads_only_a_step_with_something_to_read(queue_mod: ModuleType) -> None:
    """The twin's step guard: a manager's first step is read, a quiet one is not (its step
    counted all the same), a step after a free no index checked is, and every ``every``th
    one; a retired guard reads nothing; vLLM's method runs at each step, given its arguments."""
    reads: list[tuple[Any, int]] = []
    called: list[tuple[Any, ...]] = []

    def read(manager: Any, every: int) -> None:
        reads.append((manager, every))

    def original(manager: Any, *args: Any, **kwargs: Any) -> str:
        called.append((manager, args, kwargs))
        return "vllm's"

    manager, other = _Named(), _Named()
    guard = SimpleNamespace(retired=False)
    policy = SimpleNamespace(every=0)
    tally = [0, 0]
    places = {id(manager): (weakref.ref(manager), [None, 0])}  # a place no step has set
    new_step_starts = screen_of(queue_mod).step_guard(original, read, guard, policy, places, tally)
    assert new_step_starts(manager, 1, k=2) == "vllm's"
    assert called == [(manager, (1,), {"k": 2})]
    assert reads == [(manager, 0)]
    places[id(manager)][1][:] = [tally[1], 0]
    new_step_starts(manager)
    assert reads == [(manager, 0)]
    assert (tally[0], places[id(manager)][1][1]) == (2, 1)
    tally[1] += 1  # a guarded free no index checked
    new_step_starts(manager)
    assert len(reads) == 2
    places[id(manager)][1][:] = [tally[1], 0]
    policy.every = 2
    new_step_starts(manager)  # one step since the last full read
    new_step_starts(manager)  # the second: a full read is due
    assert reads[2:] == [(manager, 2)]
    guard.retired = True
    new_step_starts(manager)
    assert (len(reads), tally[0], len(called)) == (3, 5, 6)
    guard.retired = False
    places[id(other)] = places[id(manager)]  # another's place, found by its id: read
    new_step_starts(other)
    assert reads[-1] == (other, 2)
    # Called with no argument, as vLLM calls it, or with any.
    assert called[1:] == [(manager, (), {})] * 5 + [(other, (), {})]
    new_step_starts(other, k=3)
    new_step_starts(other, 4)
    assert called[-2:] == [(other, (), {"k": 3}), (other, (4,), {})]


def test_recent_frees_are_the_last_batches_kept() -> None:
    made = _report.frees_made()
    batches = [[object()] for _ in range(5)]
    for batch in batches:
        _report.freed(batch)
    assert _report.frees_made() == made + 5
    assert _report.recent_frees(2) == [batches[4], batches[3]]
    assert _report.recent_frees(_report._FREES + 1) is None


@pytest.fixture
def refusing(queue_mod: ModuleType) -> Iterator[tuple[Any, Any]]:
    yield from audited_pool(queue_mod, "raise")


def test_a_retried_step_raises_again_while_the_fault_stands(
    queue_mod: ModuleType, refusing: tuple[Any, Any]
) -> None:
    """A caller that catches HolderAuditError and starts the step again (an in-process
    engine, a harness with retries) is refused again: the audit did not move past the free
    that made the fault."""
    pool, manager = refusing
    table = manager.coordinator.single_type_managers[0].req_to_blocks
    step(queue_mod, manager, 64)
    table["A"] = pool.get_new_blocks(3)
    block = table["A"][1]
    pool.free_blocks([block])  # A's only reference, released while A lists it
    before = state(pool)
    for _ in range(3):
        with raises_said(_errors.HolderAuditError, f"block {block.block_id} is in the"):
            step(queue_mod, manager, 64)
        assert state(pool) == before
    # The fault gone (A's listing given up, its other blocks freed), the step passes.
    listed = table.pop("A")
    pool.free_blocks([listed[2], listed[0]])
    step(queue_mod, manager, 64)
    consistent(pool)


def test_a_retried_full_read_raises_again(queue_mod: ModuleType, refusing: tuple[Any, Any]) -> None:
    """A fault no free shows (a listing made without a reference) is found by a full read;
    the step retried reads everything again, not the frees since."""
    pool, manager = refusing
    first, second = (m.req_to_blocks for m in manager.coordinator.single_type_managers)
    step(queue_mod, manager, 2)
    first["A"] = pool.get_new_blocks(2)
    second["A"] = first["A"][:1]
    step(queue_mod, manager, 2)
    for _ in range(3):
        with raises_said(_errors.HolderAuditError, "is listed by two managers"):
            step(queue_mod, manager, 2)
    del second["A"]
    step(queue_mod, manager, 2)
    step(queue_mod, manager, 2)


def listed_by_two_managers(pool: Any, manager: Any, taken: int) -> tuple[Any, Any]:
    """The two managers' tables, request A listing ``taken`` new blocks in the first and the
    first of them in the second too: one block under two managers, with one reference."""
    first, second = (m.req_to_blocks for m in manager.coordinator.single_type_managers)
    first["A"] = pool.get_new_blocks(taken)
    second["A"] = first["A"][:1]
    return first, second


def test_a_double_listing_is_counted_once_while_it_stands(
    queue_mod: ModuleType, audited: tuple[Any, Any]
) -> None:
    """A count cannot undo a block listed by two managers: after its repair the listing
    stands, and the reads that find it again count nothing, until it has something left to
    repair (a reference dropped) or it goes and comes back."""
    pool, manager = audited
    first, second = listed_by_two_managers(pool, manager, 2)
    block = first["A"][0]
    for _ in range(3):
        step(queue_mod, manager, 1)
        assert _report.pool_repairs(pool)["two_managers"] == 1
    assert block.ref_cnt == 2
    block.ref_cnt = 1  # one of its two references dropped by hand
    step(queue_mod, manager, 1)
    assert block.ref_cnt == 2
    assert _report.pool_repairs(pool)["two_managers"] == 2
    del second["A"]
    step(queue_mod, manager, 1)  # gone: no longer standing
    second["A"] = first["A"][:1]
    step(queue_mod, manager, 1)
    assert _report.pool_repairs(pool)["two_managers"] == 3
    consistent(pool)
