"""The holder index (``kvqueue.vllm._index``): its counts against a recount after every
change of a seeded random workload, and the free list's two doors it guards (nothing but a
guarded free queues a held or listed block; ``get_new_blocks`` never hands out a listed
block) on a stand-in pool, both twins, both policies.

vLLM's own Scheduler with the index is vllm_tests/test_holder_audit.py's.
"""

from __future__ import annotations

import copy
import gc
import inspect
import pickle
import random
import sys
import tracemalloc
import weakref
from collections import defaultdict
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from kvqueue import KVCacheBlock, _errors
from kvqueue.vllm import _audit, _index, _pool_guard, _report, _screen_py
from kvqueue.vllm._lines import LINES

from support.fake_pool import consistent, guarded, make_pool, policy_of, screen_of, state
from support.helpers import link, one_line, raises_said

NEWEST = LINES[-1]


class FullAttentionManager:
    """Built as vLLM's managers are: its pool, then an empty ``req_to_blocks``."""

    def __init__(self, block_pool: Any) -> None:
        self.block_pool = block_pool
        self.req_to_blocks: Any = defaultdict(list)

    def free_state(self, request: str, i: int, replaced: bool = True) -> None:
        """vLLM's mamba manager's order: a block it lists freed, then (``replaced``) the null
        block listed in its place."""
        blocks = self.req_to_blocks[request]
        self.block_pool.free_blocks([blocks[i]])
        if replaced:
            blocks[i] = self.block_pool.null_block


class HiSparseHotManager(FullAttentionManager):
    """Named as HiSparse's: it keeps unpinned pages listed, and its table is its own."""


@pytest.fixture
def managers(screen: ModuleType) -> Iterator[type]:
    """The stand-in manager class, its ``__init__`` guarded as install() guards vLLM's, its
    indexes counting with the twin's screens."""
    originals = _index.guard_init(FullAttentionManager, None, screen)
    try:
        yield FullAttentionManager
    finally:
        _index.unguard_init(FullAttentionManager, originals)
    assert "__init__" not in vars(FullAttentionManager) or (
        vars(FullAttentionManager)["__init__"] is originals["__init__"]
    )


def recount(index: _index.Index) -> list[int]:
    """What the counts must be: every listing of every table in place, read the slow way
    (a list put in by hand aside: it is uncounted)."""
    counts = [0] * len(index.blocks)
    for table in index.live():
        for listed in dict.values(table):
            if type(listed) is not index.screen.Listed:
                continue
            for block in listed:
                block_id: Any = getattr(block, "block_id", None)
                ours = type(block_id) is int and 0 <= block_id < len(counts)
                if ours and index.blocks[block_id] is block:
                    counts[block_id] += 1
    return counts


class Pool:
    """What the index reads of a pool: its blocks, at their ids (and a weak reference)."""

    def __init__(self, n: int) -> None:
        self.blocks = [SimpleNamespace(block_id=i) for i in range(n)]


def stand_in_pool(n: int) -> Any:
    return Pool(n)


def indexed(managers: type) -> tuple[Any, Any, _index.Index]:
    """A stand-in pool of 4 blocks, a manager of ``managers`` (guarded) built on it, and the
    holder index that manager's construction gave the pool."""
    pool = stand_in_pool(4)
    made = managers(pool)
    index = _index.index_of(pool)
    assert index is not None
    return pool, made, index


def test_a_manager_built_after_the_guard_counts_and_one_before_does_not(
    managers: type, screen: ModuleType
) -> None:
    pool = stand_in_pool(4)
    before = HiSparseHotManager(pool)
    made = managers(pool)
    assert type(made.req_to_blocks) is screen.Table
    assert type(before.req_to_blocks) is defaultdict  # HiSparse's keeps its own
    index = _index.index_of(pool)
    assert index is not None
    assert index.screen is screen
    made.req_to_blocks["A"].extend(pool.blocks[1:3])
    assert index.counts == [0, 1, 1, 0]
    assert made.req_to_blocks.pop("A") == pool.blocks[1:3]
    assert index.counts == [0, 0, 0, 0]


def test_a_list_put_in_by_hand_is_kept_as_it_is_and_uncounted(managers: type) -> None:
    pool, made, index = indexed(managers)
    mine = [pool.blocks[1]]
    made.req_to_blocks["A"] = mine
    assert made.req_to_blocks.pop("A") is mine
    assert index.counts == [0, 0, 0, 0]
    made.req_to_blocks["B"].append(pool.blocks[2])
    listed = made.req_to_blocks.pop("B")
    assert index.counts == [0, 0, 0, 0]
    made.req_to_blocks["C"] = listed  # a list taken out, put back: counted again
    assert index.counts == [0, 0, 1, 0]


class UntrackingManager(FullAttentionManager):
    """A table whose lists the cyclic collector does not track, as vLLM 0.34's are."""

    def __init__(self, block_pool: Any) -> None:
        super().__init__(block_pool)

        def untracked() -> list[Any]:
            made: list[Any] = []
            _screen_py._untrack(made)
            return made

        self.req_to_blocks = defaultdict(untracked)


def test_lists_stay_out_of_the_collectors_sight_as_vllms_do(
    managers: type, screen: ModuleType
) -> None:
    originals = _index.guard_init(UntrackingManager, None, screen)
    try:
        made = UntrackingManager(stand_in_pool(2))
        tracked = managers(stand_in_pool(2))
    finally:
        _index.unguard_init(UntrackingManager, originals)
    assert type(tracked.req_to_blocks) is screen.Table
    assert type(made.req_to_blocks) is screen.Table
    assert not gc.is_tracked(made.req_to_blocks["A"])
    assert gc.is_tracked(tracked.req_to_blocks["A"])


def test_guarding_again_wraps_vllms_init_not_kvqueues() -> None:
    first = _index.guard_init(FullAttentionManager)
    again = _index.guard_init(FullAttentionManager)  # install() again, another twin
    assert again == first
    made = FullAttentionManager(stand_in_pool(2))
    assert type(made.req_to_blocks) is _screen_py.Table
    _index.unguard_init(FullAttentionManager, again)
    assert vars(FullAttentionManager)["__init__"] is first["__init__"]
    assert _index.guard_init(HiSparseHotManager) == {}  # no __init__ of its own


def test_a_manager_built_after_unguard_keeps_its_own() -> None:
    originals = _index.guard_init(FullAttentionManager)
    _index.unguard_init(FullAttentionManager, originals)
    assert vars(FullAttentionManager)["__init__"] is originals["__init__"]
    assert type(FullAttentionManager(stand_in_pool(2)).req_to_blocks) is defaultdict


# Each change a manager's code may make, on a table and its lists, drawn at random.
def _change(rng: random.Random, table: Any, pool: Any, other: list[Any]) -> None:
    requests = list(table)
    blocks = pool.blocks

    def pick() -> Any:
        return rng.choice(blocks + other)

    op = rng.randrange(16)
    if op == 0 or not requests:
        table[f"r{rng.randrange(6)}"].extend(pick() for _ in range(rng.randrange(4)))
        return
    request = rng.choice(requests)
    listed = table[request]
    if op == 1:
        listed.append(pick())
    elif op == 2:
        listed += [pick(), pick()]
    elif op == 3 and listed:
        listed[rng.randrange(len(listed))] = pick()
    elif op == 4 and listed:
        listed[: rng.randrange(len(listed))] = [pick() for _ in range(rng.randrange(3))]
    elif op == 5 and listed:
        del listed[rng.randrange(len(listed))]
    elif op == 6:
        del listed[rng.randrange(3) :]
    elif op == 7 and listed:
        listed.pop(rng.randrange(len(listed)))
    elif op == 8 and listed:
        listed.remove(rng.choice(listed))
    elif op == 9:
        listed.insert(rng.randrange(len(listed) + 1), pick())
    elif op == 10:
        listed *= rng.randrange(3)
    elif op == 11:
        table.pop(request)
    elif op == 12:
        del table[request]
    elif op == 13:
        table[request] = [pick() for _ in range(rng.randrange(3))]
    elif op == 14:
        table.update({request: [pick()], "new": [pick()]})
    else:
        table.setdefault(f"s{rng.randrange(3)}", [pick()]).append(pick())


class _Id(int):
    """A block id of an int subclass: no pool's (vLLM's ids are ints), never counted."""


@pytest.mark.parametrize("seed", range(30))
def test_the_counts_follow_every_change(managers: type, seed: int) -> None:
    rng = random.Random(seed)
    pool = stand_in_pool(12)
    # Blocks of another pool with the same ids, objects that are no block, and ids that are
    # no int exactly or out of range: never counted.
    other = [SimpleNamespace(block_id=i) for i in range(3)] + [None, "x"]
    other += [SimpleNamespace(block_id=b) for b in (True, _Id(1), -1, 12, 2**70, -(2**70))]
    made = [managers(pool) for _ in range(2)]
    index = _index.index_of(pool)
    assert index is not None
    for _ in range(300):
        _change(rng, rng.choice(made).req_to_blocks, pool, other)
        assert index.counts == recount(index)
    kept = list(made[0].req_to_blocks.values())
    made[0].req_to_blocks.clear()
    assert index.counts == recount(index)
    for listed in kept:  # out of its table, a list counts nothing
        listed.append(pool.blocks[1])
    assert index.counts == recount(index)
    assert not index.rebuild()


def test_a_copy_is_in_no_table_and_counts_nothing(managers: type) -> None:
    pool, made, index = indexed(managers)
    made.req_to_blocks["A"].extend(pool.blocks[1:3])
    copies = [
        copy.copy(made.req_to_blocks),
        copy.deepcopy(made.req_to_blocks),
        made.req_to_blocks.copy(),
        pickle.loads(pickle.dumps(made.req_to_blocks)),
    ]
    for each in copies:
        assert type(each) is defaultdict
        assert each == {"A": pool.blocks[1:3]}
        assert type(each["A"]) is list
        each["A"].append(pool.blocks[3])
        each.pop("A")
    listed = made.req_to_blocks["A"]
    for each in (copy.copy(listed), copy.deepcopy(listed), pickle.loads(pickle.dumps(listed))):
        assert type(each) is list
        each.append(pool.blocks[3])
    assert index.counts == [0, 1, 1, 0]


def test_a_change_out_of_sight_is_found_by_a_recount(managers: type) -> None:
    pool, made, index = indexed(managers)
    made.req_to_blocks["A"].append(pool.blocks[1])
    dict.pop(made.req_to_blocks, "A")  # through dict itself: the index not told
    assert index.counts[1] == 1
    assert index.rebuild()
    assert index.counts == [0, 0, 0, 0]
    made.req_to_blocks = {"B": [pool.blocks[2]]}  # a table put in the manager's place
    assert index.rebuild() is False  # the old table (now empty) lists nothing
    assert index.live() == []


# Fields, not methods: the pure twin's are slots, the compiled twin's C fields.
_FIELDS = frozenset(("manager", "name", "tally", "untracked"))


def _methods(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")} - _FIELDS


@pytest.mark.cython
def test_both_twins_make_the_same_tables() -> None:
    from kvqueue.vllm import _screen

    for name in ("Table", "Listed"):
        pure, compiled = getattr(_screen_py, name), getattr(_screen, name)
        assert _methods(pure) == _methods(compiled)
        assert compiled.__mro__[1] is pure.__mro__[1]  # dict, list: their reads are theirs
        # The compiled twin's docstrings open with the signature (embedsignature).
        for said, compiled_said in [
            (pure.__doc__, compiled.__doc__),
            *((vars(pure)[m].__doc__, vars(compiled)[m].__doc__) for m in _methods(pure)),
        ]:
            if said is not None:
                assert inspect.cleandoc(said) in inspect.cleandoc(compiled_said)
        for method in ("__missing__", "__setitem__", "__delitem__", "__reduce_ex__"):
            assert (method in vars(pure)) == (method in vars(compiled)), method


# What a caller may do to the tables and lists out of order: made without __init__, their
# index taken away, asked for what is not there. Each twin answers alike, never a crash.
_HOSTILE = (
    lambda screen: screen.Listed.__new__(screen.Listed).append(1),
    lambda screen: screen.Listed.__new__(screen.Listed).pop(),
    lambda screen: screen.Listed.__new__(screen.Listed).remove(1),
    lambda screen: screen.Listed.__new__(screen.Listed).__setitem__(0, 1),
    lambda screen: screen.Listed.__new__(screen.Listed).__delitem__(slice(None)),
    lambda screen: screen.Listed.__new__(screen.Listed).detach(),
    lambda screen: screen.Listed(None, [1, 2]).__imul__(-1),
    lambda screen: screen.Listed(SimpleNamespace(), [1]),
    lambda screen: screen.Table.__new__(screen.Table).pop("A"),
    lambda screen: screen.Table.__new__(screen.Table).popitem(),
    lambda screen: screen.Table.__new__(screen.Table).setdefault("A"),
    lambda screen: screen.Table.__new__(screen.Table).update({"A": [1]}, B=[2]),
    lambda screen: screen.Table.__new__(screen.Table).in_place(),
    lambda screen: screen.Table.__new__(screen.Table).copy(),
    lambda screen: screen.Table.__new__(screen.Table)["A"],
    lambda screen: screen.Table(None, SimpleNamespace(), False)["A"].append(1),
)


def _answer(screen: ModuleType, call: Any) -> Any:
    try:
        made = call(screen)
    except Exception as exc:  # the kind of error is the answer
        return type(exc)
    return list(made) if isinstance(made, list) else made


@pytest.mark.cython
@pytest.mark.parametrize("call", range(len(_HOSTILE)))
def test_a_table_used_out_of_order_answers_alike_in_both_twins(call: int) -> None:
    from kvqueue.vllm import _screen

    pure, compiled = (_answer(screen, _HOSTILE[call]) for screen in (_screen_py, _screen))
    assert pure == compiled


class _Meddling:
    """A block whose ``block_id`` read, the first time, changes the very list that is
    counting it (empties it, takes it out of its table) and swaps its index's counts."""

    def __init__(self, block_id: int) -> None:
        self.id, self.victim = block_id, None

    @property
    def block_id(self) -> int:
        listed, self.victim = self.victim, None
        if listed is not None:
            tally = listed.tally
            listed.clear()
            listed.detach()
            tally.counts = [0] * len(tally.counts)
        return self.id


def _meddled(screen: ModuleType) -> Any:
    blocks = [_Meddling(i) for i in range(4)]
    index = _index.Index(blocks, screen)
    listed = screen.Listed(index, blocks[:2])
    blocks[3].victim = listed
    outcome = _answer(screen, lambda _: listed.append(blocks[3]))  # its count meddles
    return outcome, [block.id for block in listed], listed.tally, index.counts


@pytest.mark.cython
def test_a_block_that_changes_its_list_while_counted_is_met_alike() -> None:
    from kvqueue.vllm import _screen

    assert _meddled(_screen_py) == _meddled(_screen)


def test_tables_churned_leave_memory_flat(managers: type) -> None:
    pool, made, index = indexed(managers)
    table = made.req_to_blocks

    def churn() -> None:
        for i in range(200):
            table[f"r{i}"].extend(pool.blocks[1:3])
        for i in range(200):
            table.pop(f"r{i}")

    churn()
    tracemalloc.start()
    try:
        churn()
        first = tracemalloc.get_traced_memory()[0]
        for _ in range(20):
            churn()
        assert tracemalloc.get_traced_memory()[0] - first < 4096
    finally:
        tracemalloc.stop()
    assert index.counts == [0, 0, 0, 0]


# -- the free list's exit, on a stand-in pool -------------------------------------------------


def exit_pool(queue_mod: ModuleType, policy: str, entry: bool = False) -> Iterator[tuple[Any, Any]]:
    """A guarded stand-in pool and its manager; ``entry``: its queue's gate is the free
    list's entry check, as install() makes it (without: a queue no gate guards)."""
    originals = _index.guard_init(
        FullAttentionManager, _pool_guard.door if entry else None, screen_of(queue_mod)
    )
    try:
        with guarded(queue_mod, NEWEST) as cls:
            pool = make_pool(cls, queue_mod, 8, policy)
            yield pool, FullAttentionManager(pool)
    finally:
        _index.unguard_init(FullAttentionManager, originals)


@pytest.fixture(params=["raise", "repair"])
def guarded_exit(queue_mod: ModuleType, request: pytest.FixtureRequest) -> Iterator[Any]:
    for pool, manager in exit_pool(queue_mod, request.param):
        yield request.param, pool, manager


@pytest.mark.parametrize("entry", [True, False], ids=["door", "no-door"])
def test_a_free_is_kept_with_its_caller_and_read_again_only_unchecked(
    queue_mod: ModuleType, entry: bool
) -> None:
    """A free the holder index did not check is kept with its caller's file and line, and read
    again by the audit; one it checked (the free list's entry is kvqueue's) is not kept: it was
    named as it was made had it been a fault, and keeping it costs a frame object a free."""
    for pool, _manager in exit_pool(queue_mod, "raise", entry=entry):
        blocks = pool.get_new_blocks(2)
        made = _report.frees_made()
        line = sys._getframe().f_lineno + 1
        pool.free_blocks(blocks)
        site = f"tests/test_holder_index.py:{line} in test_a_free_is_kept_with_its_caller_and"
        if entry:
            assert _report.last_freed(blocks[1]) is None
        else:
            assert (_report.last_freed(blocks[1]) or "").endswith(
                site + "_read_again_only_unchecked"
            )
        assert _report.frees_made() == made + (not entry)


def unguarded_release(pool: Any, block: Any) -> None:
    """A release no guarded free makes: the count lowered and the block queued, as some
    connectors and downstream pools return blocks."""
    block.ref_cnt -= 1
    pool.free_block_queue.prepend_n([block])


def test_a_listed_block_is_never_handed_out(guarded_exit: Any, repair_log: Any) -> None:
    policy, pool, manager = guarded_exit
    table = manager.req_to_blocks
    table["A"].extend(pool.get_new_blocks(2))
    block = table["A"][1]
    unguarded_release(pool, block)
    free = pool.free_block_queue.num_free_blocks
    if policy == "raise":
        before = state(pool)
        for _ in range(2):  # and again, while the fault stands
            with pytest.raises(_errors.HolderAuditError) as caught:
                pool.get_new_blocks(free)
            assert state(pool) == before
        message = one_line(caught.value)
        said = f"BlockPool.get_new_blocks() would hand out block {block.block_id}, which is in"
        assert message.startswith(said)
        assert "request 'A' (FullAttentionManager) lists it" in message
        assert "nothing was allocated" in message
        assert "test_holder_index.py" in message  # the caller, file and line
        return
    taken = pool.get_new_blocks(free - 1)
    assert all(each is not block for each in taken)
    assert block.ref_cnt == 1
    assert block.prev_free_block is None
    assert _report.pool_repairs(pool)["listed_free"] == 1
    (record,) = [r for r in repair_log.records if "listed block" in r.message]
    assert f"block {block.block_id} is in the free list (ref_cnt 0) while request 'A'" in (
        " ".join(record.message.split())  # the record's lines, one line again
    )
    consistent(pool)


def test_a_fault_made_after_the_audit_is_met_in_the_same_step(
    queue_mod: ModuleType, guarded_exit: Any
) -> None:
    """A guarded free made after the step's audit (a connector's callback) releases a
    reference a running request holds; the same step's allocation does not hand it out."""
    policy, pool, manager = guarded_exit
    coordinator = SimpleNamespace(block_pool=pool, single_type_managers=[manager])
    kv = SimpleNamespace(coordinator=coordinator)
    manager.req_to_blocks["A"].extend(pool.get_new_blocks(1))
    (block,) = manager.req_to_blocks["A"]
    _audit.audit_holders(kv, screen_of(queue_mod), policy_of, 64)
    pool.free_blocks([block])  # after the audit, in the same step
    free = pool.free_block_queue.num_free_blocks
    if policy == "raise":
        with raises_said(_errors.HolderAuditError, f"hand out block {block.block_id},"):
            pool.get_new_blocks(free)
        return
    assert all(each is not block for each in pool.get_new_blocks(free - 1))
    _audit.audit_holders(kv, screen_of(queue_mod), policy_of, 64)  # nothing left to find
    assert _report.pool_repairs(pool)["listed_free"] == 1
    consistent(pool)


@pytest.mark.parametrize(
    "door", ["own", "own, with a callback", "another pool's", "no weak reference", "none"]
)
def test_the_exit_finds_the_pools_index_by_its_door_or_its_table(
    queue_mod: ModuleType, door: str
) -> None:
    """The free list's exit and a prefix hit read the pool's index through its queue's door
    (whichever weak reference to the pool it holds), else (no door, a door of another pool,
    or one whose pool is held by anything but a weak reference, which is read, not called)
    through the table of indexes: the same index, the same refusal, before anything moves."""
    for pool, manager in exit_pool(queue_mod, "raise", entry=door != "none"):
        other = make_pool(type(pool), queue_mod, 2, "raise")
        if door == "own, with a callback":  # a reference of its own, not the pool's shared one
            pool.free_block_queue.gate.pool = weakref.ref(pool, print)
        elif door == "another pool's":
            pool.free_block_queue.gate.pool = weakref.ref(other)
        elif door == "no weak reference":
            pool.free_block_queue.gate.pool = lambda pool=pool: pool
        queue = pool.free_block_queue
        block = queue.fake_free_list_head.next_free_block
        manager.req_to_blocks["A"].append(block)  # listed, and still free
        before = state(pool)
        with raises_said(_errors.HolderAuditError, f"hand out block {block.block_id},"):
            pool.get_new_blocks(queue.num_free_blocks)
        with raises_said(_errors.HolderAuditError, f"block {block.block_id}"):
            pool.touch([block])
        assert state(pool) == before


def test_a_prefix_hit_on_a_pool_without_a_queue_is_vllms(queue_mod: ModuleType) -> None:
    """The touch guard looks for the pool's door on its queue: a pool without one (vLLM's
    ``touch`` reads it only for a free block) touches held blocks as vLLM's method does."""
    for pool, _manager in exit_pool(queue_mod, "raise", entry=True):
        blocks = pool.get_new_blocks(2)
        del pool.free_block_queue
        pool.touch(blocks)
        assert [block.ref_cnt for block in blocks] == [2, 2]


def test_the_exit_reads_the_counts_only_while_a_listed_block_may_be_free(
    queue_mod: ModuleType,
) -> None:
    """Behind the free list's entry check, a block is listed and free only if it was first
    listed while it looked free: kept in the index's ``loose`` until the exit finds it held
    or unlisted. A listing of a block vLLM handed out is not kept."""
    for pool, manager in exit_pool(queue_mod, "raise", entry=True):
        index = _index.index_of(pool)
        assert index is not None
        table = manager.req_to_blocks
        table["A"].extend(pool.get_new_blocks(2))
        assert index.loose == []
        queue = pool.free_block_queue
        block = queue.fake_free_list_head.next_free_block
        table["B"].append(block)  # listed, and still free
        assert index.loose == [block]
        with raises_said(_errors.HolderAuditError, f"hand out block {block.block_id},"):
            pool.get_new_blocks(queue.num_free_blocks)
        assert index.loose == [block]  # the fault stands
        table["B"].remove(block)
        assert any(each is block for each in pool.get_new_blocks(queue.num_free_blocks))
        assert index.loose == []


def test_a_pools_new_index_is_the_one_its_door_and_exit_read(queue_mod: ModuleType) -> None:
    """A pool whose block list is replaced gets a new index with its next manager: its door
    is given it, and the free list's exit reads that one (a listing it counts of a free block,
    out of any table's sight, sends the hand-out to the guard in full, which finds the index
    stale)."""
    for pool, _manager in exit_pool(queue_mod, "raise", entry=True):
        door = pool.free_block_queue.gate
        first = _index.index_of(pool)
        assert door.index is first
        pool.blocks = list(pool.blocks)
        FullAttentionManager(pool)
        second = _index.index_of(pool)
        assert second is not None
        assert second is not first
        assert door.index is second
        head = pool.free_block_queue.fake_free_list_head
        rebuilds = _report.index_rebuilds()
        second.add_one(head.next_free_block)  # out of any table's sight, the block free
        assert len(pool.get_new_blocks(1)) == 1
        assert _report.index_rebuilds() == rebuilds + 1


def test_a_stale_index_is_no_fault(queue_mod: ModuleType, guarded_exit: Any) -> None:
    """A listing dropped out of the index's sight leaves its count behind: the exit finds
    no table that lists the block, counts again, and hands it out."""
    _, pool, manager = guarded_exit
    manager.req_to_blocks["A"].extend(pool.get_new_blocks(1))
    (block,) = dict.pop(manager.req_to_blocks, "A")
    pool.free_blocks([block])
    rebuilds = _report.index_rebuilds()
    free = pool.free_block_queue.num_free_blocks
    assert any(each is block for each in pool.get_new_blocks(free))
    assert _report.index_rebuilds() == rebuilds + 1
    assert _report.pool_repairs(pool)["listed_free"] == 0


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("policy", ["raise", "repair"])
def test_a_sound_random_workload_is_never_refused(
    queue_mod: ModuleType, policy: str, seed: int
) -> None:
    """Requests made, grown, sharing a prefix, hitting freed blocks, sliding a window and
    finishing, as vLLM's managers do, audited each step, the free list's entry and exit
    checked: nothing refused or repaired, and after every step the index is its recount and
    the pool adds up."""
    rng = random.Random(seed)
    for pool, manager in exit_pool(queue_mod, policy, entry=True):
        coordinator = SimpleNamespace(block_pool=pool, single_type_managers=[manager])
        kv = SimpleNamespace(coordinator=coordinator)
        table = manager.req_to_blocks
        index = _index.index_of(pool)
        assert index is not None
        repairs = dict(_report.pool_repairs(pool))
        for step in range(300):
            _audit.audit_holders(kv, screen_of(queue_mod), policy_of, 4)
            live = list(table)
            free = pool.free_block_queue.num_free_blocks
            op = rng.randrange(6)
            if op == 0 and free >= 2:
                blocks: list[Any] = []
                if live:  # a prefix another request holds
                    blocks = table[rng.choice(live)][: rng.randrange(3)]
                    pool.touch(blocks)
                table[f"r{step}"].extend(blocks + pool.get_new_blocks(rng.randrange(1, 3)))
            elif op == 1 and live and free:
                table[rng.choice(live)].extend(pool.get_new_blocks(1))
            elif op == 2 and live:
                pool.free_blocks(list(reversed(table.pop(rng.choice(live)))))
            elif op == 3 and live:  # a window slid past a request's first block
                listed = table[rng.choice(live)]
                first = next((i for i, b in enumerate(listed) if not b.is_null), None)
                if first is not None:
                    old = listed[first]
                    listed[first] = pool.null_block
                    pool.free_blocks([old])
            elif op == 4 and free:  # a prefix hit on a block freed earlier
                (hit,) = pool.free_block_queue.get_all_free_blocks()[-1:]
                pool.touch([hit])
                table[f"h{step}"].append(hit)
            elif op == 5 and free:  # held a while by something that lists nothing
                pool.free_blocks(pool.get_new_blocks(rng.randrange(1, free + 1)))
            assert index.counts == recount(index)
            consistent_with_holders(pool, table)
        assert _report.pool_repairs(pool) == repairs


def consistent_with_holders(pool: Any, table: Any) -> None:
    """Every block a request lists is held at least once a listing, and out of the list."""
    listed: dict[int, int] = {}
    for blocks in table.values():
        for block in blocks:
            if not block.is_null:
                listed[id(block)] = listed.get(id(block), 0) + 1
    for block in pool.blocks:
        if id(block) in listed:
            assert block.ref_cnt >= listed[id(block)]
            assert block.prev_free_block is None
    free = pool.free_block_queue
    assert free.num_free_blocks == len(free.get_all_free_blocks())


def test_a_prefix_hit_on_a_listed_block_in_the_free_list(
    guarded_exit: Any, repair_log: Any
) -> None:
    """A block released under its holder, then hit as a cached prefix: vLLM's touch would
    take it out of the free list for a second request while the first still lists it."""
    policy, pool, manager = guarded_exit
    table = manager.req_to_blocks
    table["A"].extend(pool.get_new_blocks(2))
    block = table["A"][1]
    unguarded_release(pool, block)
    if policy == "raise":
        before = state(pool)
        with pytest.raises(_errors.HolderAuditError) as caught:
            pool.touch([block])
        assert state(pool) == before
        message = one_line(caught.value)
        said = f"BlockPool.touch() would give block {block.block_id}, which is in the free list"
        assert message.startswith(said)
        assert "request 'A' (FullAttentionManager) lists it, to a prefix hit" in message
        assert "test_holder_index.py" in message  # the caller, file and line
        return
    pool.touch([block])
    table["B"].append(block)
    assert block.ref_cnt == 2  # its listing's and the hit's
    assert block.prev_free_block is None
    assert _report.pool_repairs(pool)["listed_free"] == 1
    (record,) = [r for r in repair_log.records if "prefix hit" in r.message]
    assert "ref_cnt 0 -> 1" in " ".join(record.message.split())
    consistent_with_holders(pool, table)


def test_a_prefix_hit_on_a_listed_block_out_of_the_list_unlinks_nothing(
    guarded_exit: Any, repair_log: Any
) -> None:
    """A count lowered by hand, the block never queued: the repair gives the listing its
    reference back and asks the queue to unlink nothing (no queue repair counted)."""
    policy, pool, manager = guarded_exit
    if policy == "raise":
        pytest.skip("the refusal is the same as for a block in the list")
    table = manager.req_to_blocks
    table["A"].extend(pool.get_new_blocks(1))
    (block,) = table["A"]
    block.ref_cnt -= 1
    pool.touch([block])
    table["B"].append(block)
    assert block.ref_cnt == 2
    assert pool.free_block_queue.repairs["not_linked"] == 0
    assert _report.pool_repairs(pool)["listed_free"] == 1
    consistent_with_holders(pool, table)


# -- the free list's entry, on a stand-in pool ------------------------------------------------


@pytest.fixture(params=["raise", "repair"])
def guarded_entry(queue_mod: ModuleType, request: pytest.FixtureRequest) -> Iterator[Any]:
    for pool, manager in exit_pool(queue_mod, request.param, entry=True):
        yield request.param, pool, manager


@pytest.mark.parametrize("method", ["append", "append_n", "prepend_n"])
def test_a_listed_block_released_by_hand_is_not_queued(
    guarded_entry: Any, method: str, repair_log: Any
) -> None:
    policy, pool, manager = guarded_entry
    table = manager.req_to_blocks
    table["A"].extend(pool.get_new_blocks(2))
    block = table["A"][1]
    block.ref_cnt -= 1  # released by no guarded free
    if policy == "raise":
        before = state(pool)
        for _ in range(2):  # and again, while the fault stands
            with pytest.raises(_errors.HolderAuditError) as caught:
                link(pool.free_block_queue, method, [block])
            assert state(pool) == before
        message = one_line(caught.value)
        said = f"FreeKVCacheBlockQueue.{method}() would queue block {block.block_id} free, "
        assert message.startswith(said + "which request 'A' (FullAttentionManager) lists")
        assert "nothing was queued" in message
        assert "helpers.py" in message  # the caller (the test's link()), file and line
        return
    link(pool.free_block_queue, method, [block])
    assert block.ref_cnt == 1  # its listing's reference, given back
    assert block.prev_free_block is None
    assert _report.pool_repairs(pool)["listed_free"] == 1
    (record,) = [r for r in repair_log.records if "queued a held block" in r.message]
    message = " ".join(record.message.split())  # the record's lines, one line again
    assert f"block {block.block_id} request 'A' (FullAttentionManager) lists" in message
    assert "left out of the free list, ref_cnt 0 -> 1" in message
    consistent(pool)


def test_a_held_block_is_not_queued_and_the_rest_of_its_batch_is(guarded_entry: Any) -> None:
    """A block queued with its reference (a connector's ``append_n`` of a block it holds):
    the scheduler would count it free, and the allocation after would find it held."""
    policy, pool, _ = guarded_entry
    held, spare = pool.get_new_blocks(2)
    spare.ref_cnt = 0
    if policy == "raise":
        before = state(pool)
        with raises_said(_errors.HolderAuditError, "which holds 1 reference:"):
            pool.free_block_queue.append_n([spare, held])
        assert state(pool) == before
        return
    free = pool.free_block_queue.num_free_blocks
    pool.free_block_queue.append_n([spare, held])
    assert pool.free_block_queue.num_free_blocks == free + 1
    assert held.ref_cnt == 1
    assert held.prev_free_block is None
    assert spare.prev_free_block is not None
    assert _report.pool_repairs(pool)["held_free"] == 1
    # Every block counted free can be handed out: none is found held at the exit.
    assert len(pool.get_new_blocks(free + 1)) == free + 1


def test_a_manager_frees_a_block_it_lists_then_replaces_it(guarded_entry: Any) -> None:
    """vLLM's own frees are checked by their guard, not at the entry; a manager of the pool
    may free a block before its listing is replaced (vLLM's mamba manager frees a state
    block, then lists the null block in its place)."""
    _, pool, manager = guarded_entry
    table = manager.req_to_blocks
    table["A"].extend(pool.get_new_blocks(2))
    block = table["A"][0]
    manager.free_state("A", 0)
    assert block.prev_free_block is not None
    assert sum(_report.pool_repairs(pool).values()) == 0
    # Let through listed: the exit reads the index until it finds the listing gone.
    index = _index.index_of(pool)
    assert index is not None
    assert index.loose == [block]
    consistent(pool)


def test_a_free_of_a_reference_its_holder_holds_is_the_faulty_call(
    guarded_entry: Any, repair_log: Any
) -> None:
    """Anything but a manager of the pool (a connector's callback) that frees a reference a
    live request still holds: refused before any count moves, named with the caller's file
    and line; or left out, the block with its holder."""
    policy, pool, manager = guarded_entry
    table = manager.req_to_blocks
    table["A"].extend(pool.get_new_blocks(2))
    block = table["A"][1]
    if policy == "raise":
        before = state(pool)
        for _ in range(2):  # and again, while the fault stands
            with pytest.raises(_errors.HolderAuditError) as caught:
                pool.free_blocks([block])
            assert state(pool) == before
        message = one_line(caught.value)
        said = f"BlockPool.free_blocks() would release block {block.block_id}, which "
        assert message.startswith(said + "request 'A' (FullAttentionManager) lists (ref_cnt 1)")
        assert "nothing was released" in message
        assert "test_holder_index.py" in message  # the faulty call, file and line
        return
    (other,) = pool.get_new_blocks(1)
    pool.free_blocks([block, other])
    assert block.ref_cnt == 1
    assert block.prev_free_block is None
    assert other.prev_free_block is not None  # listed by none: the rest of the batch is freed
    assert {k: n for k, n in _report.pool_repairs(pool).items() if n} == {"listed_free": 1}
    (record,) = [r for r in repair_log.records if "a held reference" in r.getMessage()]
    assert f"block {block.block_id}, which request 'A'" in one_line(record.getMessage())


def test_the_entry_is_open_once_the_guard_is_off(queue_mod: ModuleType) -> None:
    for pool, manager in exit_pool(queue_mod, "raise", entry=True):
        table = manager.req_to_blocks
        table["A"].extend(pool.get_new_blocks(1))
        (block,) = table["A"]
        assert _pool_guard.is_door(pool.free_block_queue.gate)
    block.ref_cnt -= 1
    pool.free_block_queue.prepend_n([block])  # unguarded: vLLM's own behaviour
    assert block.prev_free_block is not None
    index = pool.free_block_queue.gate.index
    assert index.loose == [block]  # listed and let in: an exit guard would read the index


class _Pruning:
    """A block whose ``ref_cnt`` read prunes its index once, as a listing of it is counted."""

    def __init__(self, block_id: int, index: Any) -> None:
        self.block_id, self.is_null, self.prev_free_block = block_id, False, None
        self.index: Any = index

    @property
    def ref_cnt(self) -> int:
        index, self.index = self.index, None
        if index is not None:
            index.prune()
        return 0


def test_a_prune_inside_a_count_keeps_what_the_count_adds(queue_mod: ModuleType) -> None:
    """A field read as a listing is counted may run code that prunes the index: the block
    listed while free is still kept loose."""
    index = _index.Index([], screen_of(queue_mod))
    block = _Pruning(0, index)
    index.blocks.append(block)
    index.counts.append(0)
    index.add_one(block)
    assert index.counts == [1]
    assert index.loose == [block]


def test_loose_holds_at_most_what_is_listed_and_free(queue_mod: ModuleType) -> None:
    """Where no exit prunes it (the guard off), what is let in is pruned once it outgrows
    the pool."""
    blocks = [KVCacheBlock(i) for i in range(4)]
    index = _index.Index(blocks, screen_of(queue_mod))
    index.add_one(blocks[0])  # listed while free
    assert index.loose == [blocks[0]]
    for _ in range(3):
        index.let_in(blocks[1:2])  # not listed
    assert len(index.loose) == 4
    index.let_in(blocks[2:3])
    assert index.loose == [blocks[0]]


# -- the audit between its full reads, through the index ----------------------------------------


class CountingScreen:
    """The twin's screens, counting the holder audit's reads of the listings."""

    def __init__(self, screen: ModuleType) -> None:
        self.screen = screen
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.screen, name)

    def holder_faults(self, *args: Any) -> Any:
        self.reads += 1
        return self.screen.holder_faults(*args)


class KVCacheManager:
    """What the audit reads of vLLM's: its coordinator (and a weak reference, by which the
    audit keeps its place between steps)."""

    def __init__(self, pool: Any, manager: Any) -> None:
        self.coordinator = SimpleNamespace(block_pool=pool, single_type_managers=[manager])


def audited(queue_mod: ModuleType, pool: Any, manager: Any) -> tuple[Any, Any]:
    return KVCacheManager(pool, manager), CountingScreen(screen_of(queue_mod))


@pytest.mark.parametrize("every", [0, 64])
def test_between_full_reads_a_sound_free_reads_no_listing(
    queue_mod: ModuleType, every: int
) -> None:
    for pool, manager in exit_pool(queue_mod, "raise", entry=True):
        kv, screen = audited(queue_mod, pool, manager)
        table = manager.req_to_blocks
        table["A"].extend(pool.get_new_blocks(3))
        table["B"].extend(pool.get_new_blocks(2))
        _audit.audit_holders(kv, screen, policy_of, every)  # a manager's first: a full read
        assert screen.reads == 1
        for _ in range(70):
            pool.free_blocks(reversed(table.pop("B")))
            table["B"].extend(pool.get_new_blocks(2))
            pool.touch(table["A"][:1])  # a prefix hit: two references, one listing
            _audit.audit_holders(kv, screen, policy_of, every)
        # The freed blocks looked up in the index, not read; a full read every 64 steps.
        assert screen.reads == 1 + (70 // every if every else 0)


@pytest.mark.parametrize("policy", ["raise", "repair"])
def test_between_full_reads_a_listed_block_freed_is_found_at_the_next_step(
    queue_mod: ModuleType, policy: str
) -> None:
    for pool, manager in exit_pool(queue_mod, policy, entry=True):
        kv, screen = audited(queue_mod, pool, manager)
        table = manager.req_to_blocks
        table["A"].extend(pool.get_new_blocks(2))
        _audit.audit_holders(kv, screen, policy_of, 64)
        # A manager's own free that does not drop its listing: let through at the free,
        # found at the next step.
        block = table["A"][1]
        manager.free_state("A", 1, replaced=False)
        if policy == "raise":
            for _ in range(2):  # and again, while the fault stands
                with pytest.raises(_errors.HolderAuditError) as caught:
                    _audit.audit_holders(kv, screen, policy_of, 64)
                said = one_line(caught.value)
                assert f"block {block.block_id} is" in said
                # The free let through is the one the audit reads again, and names.
                released = said.split("no holder index checked was a free called from ")[1]
                assert released.split(". ")[0].endswith(" in free_state")
            return
        _audit.audit_holders(kv, screen, policy_of, 64)
        assert block.ref_cnt == 1
        assert block.prev_free_block is None
        assert _report.pool_repairs(pool)["listed_free"] == 1
        consistent_with_holders(pool, table)


def test_between_full_reads_a_stale_suspect_is_no_fault(queue_mod: ModuleType) -> None:
    """A listing dropped out of the index's sight: its freed block looks listed, the listings
    read say it is not; the index is counted again, nothing reported."""
    for pool, manager in exit_pool(queue_mod, "raise", entry=True):
        kv, screen = audited(queue_mod, pool, manager)
        table = manager.req_to_blocks
        table["A"].extend(pool.get_new_blocks(2))
        _audit.audit_holders(kv, screen, policy_of, 64)
        blocks = dict.pop(table, "A")  # through dict itself: the index not told
        rebuilds = _report.index_rebuilds()
        pool.free_blocks(blocks)
        _audit.audit_holders(kv, screen, policy_of, 64)
        assert _report.index_rebuilds() == rebuilds + 1
        index = _index.index_of(pool)
        assert index is not None
        assert index.counts == recount(index)
        assert sum(_report.pool_repairs(pool).values()) == 0
