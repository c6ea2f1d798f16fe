"""The pool guard (``_pool_guard``) on a stand-in ``BlockPool`` of every vLLM line, with
each twin's queue and screens: hostile callers, hostile blocks, hostile log handlers.
vLLM's real pools: vllm_tests/test_double_free.py and vllm_tests/test_guard_hostile.py."""

from __future__ import annotations

import functools
import gc
import logging
import math
import re
import sys
from collections.abc import Iterator
from fractions import Fraction
from types import ModuleType
from typing import Any, cast

import pytest

from kvqueue import KVCacheBlock
from kvqueue._errors import VLLMLayoutError
from kvqueue.vllm import _pool_guard
from kvqueue.vllm._lines import LINES, Line

from isolated.guard_cases import CASES as ISOLATED_CASES
from support import vllm_stubs
from support.blocks import VllmStyleBlock
from support.fake_pool import (
    block_class,
    consistent,
    guarded,
    make_pool,
    policy_of,
    pool_class,
    screen_of,
    state,
)
from support.helpers import one_line, raises_said, run_isolated

LINE_IDS = [each.name for each in LINES]
NEWEST = LINES[-1]


@pytest.fixture(params=LINES, ids=LINE_IDS)
def each_line(request: pytest.FixtureRequest) -> Line:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def quiet(repair_log: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    return repair_log


def _pool(queue_mod: ModuleType, of: Line, policy: str, n: int = 8) -> Iterator[Any]:
    with guarded(queue_mod, of) as cls:
        yield make_pool(cls, queue_mod, n, policy)


# --- every line's layout -------------------------------------------------------------


@pytest.mark.parametrize("policy", ["raise", "repair"])
def test_a_double_free_in_one_call_on_every_line(
    queue_mod: ModuleType, each_line: Line, policy: str, quiet: Any
) -> None:
    for pool in _pool(queue_mod, each_line, policy):
        (block,) = pool.get_new_blocks(1)
        before = state(pool)
        if policy == "raise":
            with raises_said(ValueError, "2 times while it holds 1 reference:"):
                pool.free_blocks([block, block])
            assert state(pool) == before
        else:
            pool.free_blocks([block, block])
            assert block.ref_cnt == 0
            assert _pool_guard.pool_repairs(pool)["double_free"] == 1
        consistent(pool)


def test_a_block_listed_as_often_as_it_is_held_is_queued_once(
    queue_mod: ModuleType, each_line: Line
) -> None:
    """0.18-0.23 release every occurrence before they queue those at 0: a block held twice and
    listed twice would be queued twice, and the queue would refuse the second link."""
    for pool in _pool(queue_mod, each_line, "raise"):
        first, second = pool.get_new_blocks(2)
        pool.touch([first])
        pool.free_blocks([first, second, first])
        assert first.ref_cnt == second.ref_cnt == 0
        assert pool.free_block_queue.repairs == dict.fromkeys(pool.free_block_queue.repairs, 0)
        consistent(pool)


def test_a_block_listed_more_often_than_it_is_held_is_queued_once(
    queue_mod: ModuleType, each_line: Line, quiet: Any
) -> None:
    """Under repair the excess is dropped, and what is left takes the block to 0 once."""
    for pool in _pool(queue_mod, each_line, "repair"):
        (block,) = pool.get_new_blocks(1)
        pool.touch([block])
        pool.free_blocks([block, block, block])
        assert block.ref_cnt == 0
        assert _pool_guard.pool_repairs(pool)["double_free"] == 1
        assert pool.free_block_queue.repairs == dict.fromkeys(pool.free_block_queue.repairs, 0)
        consistent(pool)


def test_blocks_without_a_pool_field_are_the_pools_own(queue_mod: ModuleType) -> None:
    """Before 0.30 a block has no ``pool``: the guard must not read one."""
    for of in LINES:
        if of.has_pool_field:
            continue
        assert not hasattr(block_class(of)(0), "pool")
        for pool in _pool(queue_mod, of, "raise"):
            (block,) = pool.get_new_blocks(1)
            pool.touch([block])
            with raises_said(ValueError, "3 time"):
                pool.free_blocks([block, block, block])
            pool.free_blocks([block, block])
            consistent(pool)


def test_blocks_made_outside_the_pool_keep_vllms_handling_before_0_30(
    queue_mod: ModuleType,
) -> None:
    """vLLM 0.23-0.29's own tests free blocks they built themselves (``KVCacheBlock(1000)``):
    with no ``pool`` field, a block is the pool's own only if the pool's list holds it."""
    for of in LINES:
        if of.has_pool_field:
            continue
        for pool in _pool(queue_mod, of, "raise"):
            stray = block_class(of)(1000)
            twin = block_class(of)(1)  # the id of a block of the pool, but not that block
            pool.free_blocks([stray, twin])
            assert (stray.ref_cnt, twin.ref_cnt) == (-1, -1)
            pool.touch([stray])
            assert stray.ref_cnt == 0
            consistent(pool)


def test_only_the_methods_a_line_has_are_guarded(each_line: Line) -> None:
    cls = pool_class(each_line)
    import kvqueue.vllm._screen_py as screen

    found = _pool_guard.guard(cls, screen, policy_of, wrap_foreign=False, line=each_line)
    assert sorted(found) == sorted(each_line.pool_methods)
    _pool_guard.unguard(cls, found)


def test_null_blocks_keep_vllms_handling(queue_mod: ModuleType, each_line: Line) -> None:
    for pool in _pool(queue_mod, each_line, "raise"):
        null = pool.null_block
        pool.touch([null, null])
        pool.free_blocks([null, null, null])
        assert null.ref_cnt == (0 if each_line.skips_null else -1)
        consistent(pool)


# --- the wrapped method's own parameters, whatever the line names them ------------------


def test_the_guard_takes_vllms_keywords(queue_mod: ModuleType, each_line: Line, quiet: Any) -> None:
    blocks_name = each_line.pool_methods["free_blocks"][0]
    for pool in _pool(queue_mod, each_line, "repair"):
        taken = pool.get_new_blocks(num_blocks=3)
        pool.touch(blocks=taken[:1])
        pool.free_blocks(**{blocks_name: [taken[0], taken[0], taken[0]]})
        assert taken[0].ref_cnt == 0
        assert _pool_guard.pool_repairs(pool)["double_free"] == 1
        with pytest.raises(TypeError):
            pool.free_blocks(not_a_parameter=[taken[1]])
        with pytest.raises(TypeError):
            pool.free_blocks([taken[1]], **{blocks_name: [taken[1]]})
        with pytest.raises(TypeError):
            pool.free_blocks()
        assert taken[1].ref_cnt == 1  # none of the refused calls freed it
        if "prepend" in each_line.pool_methods["free_blocks"]:
            pool.free_blocks(ordered_blocks=[taken[1]], prepend=True)
            assert pool.free_block_queue.get_all_free_blocks()[0] is taken[1]
        else:
            with pytest.raises(TypeError):
                pool.free_blocks([taken[1]], prepend=True)
            assert taken[1].ref_cnt == 1
        if "unpin_blocks" in each_line.pool_methods:
            pool.unpin_blocks(blocks=[taken[2]], on_reuse=print)
            assert taken[2].ref_cnt == 0
        consistent(pool)


def test_a_misused_call_with_wrong_arguments_raises_vllms_error_unrepaired(
    queue_mod: ModuleType, quiet: Any
) -> None:
    for pool in _pool(queue_mod, NEWEST, "repair"):
        (block,) = pool.get_new_blocks(1)
        with pytest.raises(TypeError):  # one argument more than any line's free_blocks takes
            pool.free_blocks([block, block], True, True)
        assert block.ref_cnt == 1
        assert _pool_guard.pool_repairs(pool)["double_free"] == 0


# --- item 11: every count vLLM's queue takes ----------------------------------------------


class _Count(int):
    pass


class _Indexed:
    def __index__(self) -> int:
        return 1


@pytest.mark.parametrize("count", [True, _Count(1), _Indexed()], ids=["bool", "subclass", "index"])
def test_any_count_is_screened(queue_mod: ModuleType, count: Any, quiet: Any) -> None:
    for pool in _pool(queue_mod, NEWEST, "raise"):
        held = pool.free_block_queue.get_all_free_blocks()[0]
        held.ref_cnt = 1  # a reference taken without touch()
        before = state(pool)
        with raises_said(ValueError, f"would hand out block {held.block_id}"):
            pool.get_new_blocks(count)
        assert state(pool) == before
    for pool in _pool(queue_mod, NEWEST, "repair"):
        held = pool.free_block_queue.get_all_free_blocks()[0]
        held.ref_cnt = 1
        (given,) = pool.get_new_blocks(count)
        assert given is not held
        consistent(pool)


def test_a_held_block_found_makes_every_later_count_true(queue_mod: ModuleType, quiet: Any) -> None:
    """A held block among the first free ones means the count the caller read was wrong:
    every held block in the list is unlinked then, not only those handed out next."""
    for pool in _pool(queue_mod, NEWEST, "repair", n=12):
        free = pool.free_block_queue.get_all_free_blocks()
        for block in (free[0], free[5], free[9]):
            block.ref_cnt = 1
        given = pool.get_new_blocks(2)
        assert not {id(b) for b in given} & {id(free[0]), id(free[5]), id(free[9])}
        assert _pool_guard.pool_repairs(pool)["held_free"] == 3
        consistent(pool)


# --- item 10: a count that is no integer -------------------------------------------------


@pytest.mark.parametrize(
    "value", [0.5, 2.5, math.nan, Fraction(3, 2), "1"], ids=["half", "2.5", "nan", "frac", "str"]
)
@pytest.mark.parametrize("policy", ["raise", "repair"])
def test_a_ref_cnt_that_is_no_integer(queue_mod: ModuleType, value: Any, policy: str) -> None:
    for pool in _pool(queue_mod, NEWEST, policy):
        taken = pool.get_new_blocks(2)
        taken[1].ref_cnt = value
        before = state(pool)
        message = f"block {taken[1].block_id} whose ref_cnt is .*, not an integer; nothing"
        with raises_said(TypeError, message):
            pool.free_blocks(taken)
        with raises_said(TypeError, message):
            pool.touch(taken)
        assert state(pool) == before
        free = pool.free_block_queue.get_all_free_blocks()
        free[0].ref_cnt = value
        before = state(pool)
        with raises_said(TypeError, f"block {free[0].block_id} whose ref_cnt"):
            pool.get_new_blocks(1)
        assert state(pool) == before


# --- item 8: another pool's blocks, under its "raise" --------------------------------------


@pytest.mark.parametrize("policy", ["raise", "repair"])
def test_another_pools_misuse_raises_before_anything_is_freed(
    queue_mod: ModuleType, policy: str, quiet: Any
) -> None:
    for of in LINES:
        if not of.has_pool_field:
            continue
        with guarded(queue_mod, of) as cls:
            mine = make_pool(cls, queue_mod, 6, policy)
            theirs = make_pool(cls, queue_mod, 6, "raise")
            (a,) = mine.get_new_blocks(1)
            (b,) = theirs.get_new_blocks(1)
            before = state(mine), state(theirs)
            with raises_said(ValueError, f"block {b.block_id} 2 time"):
                mine.free_blocks([a, b, b])
            assert (state(mine), state(theirs)) == before
            mine.free_blocks([a, b])
            consistent(mine)
            consistent(theirs)


@pytest.mark.parametrize("method", ["free_blocks", "unpin_blocks"])
def test_a_stray_block_is_refused_before_any_count_moves(
    queue_mod: ModuleType, method: str, quiet: Any
) -> None:
    """A block vLLM would count and queue here, which this pool's queue
    refuses (of no pool; to unpin_blocks, of another pool too), is refused up front under
    "raise": vLLM had moved every count, and the queue's refusal left the rest at 0, lost."""
    for of in LINES:
        if method not in of.pool_methods or not of.has_pool_field:
            continue
        with guarded(queue_mod, of) as cls:
            mine = make_pool(cls, queue_mod, 6, "raise")
            theirs = make_pool(cls, queue_mod, 6, "raise")
            own = mine.get_new_blocks(3)
            strays = [VllmStyleBlock(99, ref_cnt=1)]
            if method == "unpin_blocks":
                strays += theirs.get_new_blocks(1)
            for stray in strays:
                words = "a block of no pool" if stray.pool is None else "a block of another"
                before = state(mine), state(theirs), stray.ref_cnt
                args = (print,) if method == "unpin_blocks" else ()
                with raises_said(ValueError, f"{words}.*Pool: BlockPool"):
                    getattr(mine, method)([*own, stray], *args)
                assert (state(mine), state(theirs), stray.ref_cnt) == before
            consistent(mine)
            # vLLM's own tests free blocks of no pool at 0 (never queued): vLLM's handling.
            unqueued = VllmStyleBlock(98)
            mine.free_blocks([unqueued])
            assert unqueued.ref_cnt == -1
            mine.free_blocks(own)
            consistent(mine)


def test_another_pools_misuse_under_its_repair_is_repaired_there(
    queue_mod: ModuleType, quiet: Any
) -> None:
    with guarded(queue_mod, NEWEST) as cls:
        mine = make_pool(cls, queue_mod, 6, "raise")
        theirs = make_pool(cls, queue_mod, 6, "repair")
        (a,) = mine.get_new_blocks(1)
        (b,) = theirs.get_new_blocks(1)
        mine.free_blocks([a, b, b])
        assert a.ref_cnt == b.ref_cnt == 0
        assert _pool_guard.pool_repairs(theirs)["double_free"] == 1
        consistent(mine)
        consistent(theirs)


# --- vLLM 0.34+: blocks name their pool by a weak reference, free_blocks(evict_first) ---

WEAK_LINES = [each for each in LINES if each.weak_pool]


@pytest.fixture(params=WEAK_LINES, ids=[each.name for each in WEAK_LINES])
def weak_line(request: pytest.FixtureRequest) -> Line:
    return request.param  # type: ignore[no-any-return]


@pytest.mark.parametrize("policy", ["raise", "repair"])
def test_a_block_whose_pool_is_gone_is_skipped_as_vllm_skips_it(
    queue_mod: ModuleType, weak_line: Line, policy: str, quiet: Any
) -> None:
    """0.34's free_blocks skips a block whose pool is gone, however often it is given."""
    with guarded(queue_mod, weak_line) as cls:
        mine = make_pool(cls, queue_mod, 6, policy)
        gone = make_pool(cls, queue_mod, 4, policy)
        (orphan,) = gone.get_new_blocks(1)
        del gone
        gc.collect()
        assert orphan.pool is not None
        assert orphan.pool() is None
        (a,) = mine.get_new_blocks(1)
        mine.free_blocks([orphan, a, orphan])
        assert (orphan.ref_cnt, a.ref_cnt) == (1, 0)
        assert _pool_guard.pool_repairs(mine) == dict.fromkeys(_pool_guard.pool_repairs(mine), 0)
        consistent(mine)


@pytest.mark.parametrize("policy", ["raise", "repair"])
def test_blocks_of_a_live_pool_and_of_no_pool_by_weak_reference(
    queue_mod: ModuleType, weak_line: Line, policy: str, quiet: Any
) -> None:
    """Another live pool's block goes to that pool (its double free screened there first);
    a block of no pool is released as vLLM releases it, unscreened."""
    with guarded(queue_mod, weak_line) as cls:
        mine = make_pool(cls, queue_mod, 6, "repair")
        theirs = make_pool(cls, queue_mod, 6, policy)
        (a,) = mine.get_new_blocks(1)
        (b,) = theirs.get_new_blocks(1)
        assert b.pool is weak_line.pool_ref(theirs)
        assert b.pool() is theirs
        stray = block_class(weak_line)(99, ref_cnt=1)
        if policy == "raise":
            before = (state(mine), state(theirs), stray.ref_cnt)
            with raises_said(ValueError, "given block 1 2 time"):
                mine.free_blocks([a, b, stray, b])
            assert (state(mine), state(theirs), stray.ref_cnt) == before
            mine.free_blocks([a, b, stray])
        else:
            mine.free_blocks([a, b, stray, b])
            assert _pool_guard.pool_repairs(theirs)["double_free"] == 1
        assert (a.ref_cnt, b.ref_cnt, stray.ref_cnt) == (0, 0, 0)
        assert _pool_guard.pool_repairs(mine)["double_free"] == 0
        consistent(mine)
        consistent(theirs)


@pytest.mark.parametrize(
    "call",
    ["position", "keyword", "all_keywords"],
)
@pytest.mark.parametrize("policy", ["raise", "repair"])
def test_evict_first_by_position_and_by_keyword(
    queue_mod: ModuleType, weak_line: Line, policy: str, call: str, quiet: Any
) -> None:
    """A double free with evict_first: screened alike, and vLLM is given evict_first as
    it was passed (cached blocks to the front, here and in the other pool it hands to)."""
    blocks_name, flag_name = weak_line.pool_methods["free_blocks"]
    hash_name = weak_line.block_fields[3]

    def free(pool: Any, blocks: list[Any]) -> None:
        if call == "position":
            pool.free_blocks(blocks, True)
        elif call == "keyword":
            pool.free_blocks(blocks, **{flag_name: True})
        else:
            pool.free_blocks(**{blocks_name: blocks, flag_name: True})

    with guarded(queue_mod, weak_line) as cls:
        mine = make_pool(cls, queue_mod, 6, policy)
        theirs = make_pool(cls, queue_mod, 6, policy)
        a, b = mine.get_new_blocks(2)
        (c,) = theirs.get_new_blocks(1)
        for block in (a, b, c):
            setattr(block, hash_name, b"cached")  # without evict_first: queued last
        if policy == "raise":
            before = (state(mine), state(theirs))
            with raises_said(ValueError, "double free"):
                free(mine, [a, c, a, b])
            assert (state(mine), state(theirs)) == before
            free(mine, [a, c, b])
        else:
            free(mine, [a, c, a, b])
            assert _pool_guard.pool_repairs(mine)["double_free"] == 1
        assert (a.ref_cnt, b.ref_cnt, c.ref_cnt) == (0, 0, 0)
        assert {id(x) for x in mine.free_block_queue.get_all_free_blocks()[:2]} == {id(a), id(b)}
        assert theirs.free_block_queue.get_all_free_blocks()[0] is c
        consistent(mine)
        consistent(theirs)


# --- item 9: a log handler cannot fail a call -------------------------------------------


class _Raising(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        raise RuntimeError("a broken log filter")


@pytest.fixture
def broken_log(repair_log: pytest.LogCaptureFixture) -> Iterator[None]:
    logger = logging.getLogger("kvqueue")
    broken = _Raising()
    logger.addFilter(broken)
    try:
        yield
    finally:
        logger.removeFilter(broken)


def test_a_raising_log_filter_does_not_fail_a_repaired_call(
    queue_mod: ModuleType, broken_log: None
) -> None:
    for pool in _pool(queue_mod, NEWEST, "repair"):
        taken = pool.get_new_blocks(2)
        pool.free_blocks([taken[0], taken[0]])
        assert taken[0].ref_cnt == 0
        free = pool.free_block_queue.get_all_free_blocks()
        free[0].ref_cnt = 1
        assert free[0] not in pool.get_new_blocks(1)
        assert pool.free_block_queue.repairs["duplicate"] == 0
        pool.free_block_queue.append_n([taken[1], taken[1]])  # the queue's own repair log
        assert pool.free_block_queue.repairs["duplicate"] == 1


# --- items 6 and 7: kvqueue's guards by identity, switched in one assignment -----------------


def test_a_wraps_wrapper_is_named_by_where_its_code_is(queue_mod: ModuleType) -> None:
    """A functools.wraps wrapper over a guarded method is named by the
    file and line of its code, not by the name it copied from vLLM's method."""
    cls = pool_class(NEWEST)
    vllms = cls.__dict__["free_blocks"]

    @functools.wraps(vllms)
    def theirs(*args: Any, **kwargs: Any) -> Any:
        return vllms(*args, **kwargs)

    cls.free_blocks = theirs  # type: ignore[attr-defined]
    line = cast(Any, theirs).__code__.co_firstlineno
    with pytest.raises(VLLMLayoutError) as refused:
        _pool_guard.guard(cls, screen_of(queue_mod), policy_of, wrap_foreign=False, line=NEWEST)
    where = rf"a wrapper defined at \S*tests/test_pool_guard.py:{line} \(named "
    assert re.search(where, one_line(refused.value))


def test_a_copied_guard_marker_is_not_kvqueues_guard(queue_mod: ModuleType, quiet: Any) -> None:
    import kvqueue.vllm._screen_py as pure

    with guarded(queue_mod, NEWEST) as cls:
        ours = cls.__dict__["free_blocks"]
        calls = []

        @functools.wraps(ours)
        def theirs(*args: Any, **kwargs: Any) -> Any:
            calls.append(args)
            return ours(*args, **kwargs)

        cls.free_blocks = theirs  # type: ignore[attr-defined]
        with raises_said(VLLMLayoutError, "free_blocks is not vLLM's own"):
            _pool_guard.guard(cls, pure, policy_of, wrap_foreign=False, line=NEWEST)
        assert cls.__dict__["free_blocks"] is theirs
        found = _pool_guard.guard(cls, pure, policy_of, wrap_foreign=True, line=NEWEST)
        assert found["free_blocks"] is theirs
        pool = make_pool(cls, queue_mod, 4, "repair")
        (block,) = pool.get_new_blocks(1)
        pool.free_blocks([block, block])
        assert len(calls) == 1
        assert _pool_guard.pool_repairs(pool)["double_free"] == 1  # once, not by both guards
        _pool_guard.unguard(cls, found)
        assert cls.__dict__["free_blocks"] is theirs
        # Under theirs, the first guard is retired: vLLM's method runs as if unguarded.
        (block,) = pool.get_new_blocks(1)
        pool.free_blocks([block, block])
        assert block.ref_cnt == -1
        assert _pool_guard.pool_repairs(pool)["double_free"] == 1


def test_unguard_leaves_no_guard_under_a_later_patch(queue_mod: ModuleType) -> None:
    cls = pool_class(NEWEST)
    found = _pool_guard.guard(cls, screen_of(queue_mod), policy_of, wrap_foreign=False, line=NEWEST)
    ours = cls.__dict__["free_blocks"]

    def later(self: Any, *args: Any, **kwargs: Any) -> Any:
        return ours(self, *args, **kwargs)

    cls.free_blocks = later  # type: ignore[attr-defined]
    _pool_guard.unguard(cls, found)
    assert cls.__dict__["free_blocks"] is later
    pool = make_pool(cls, queue_mod, 4, "raise")
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block, block])  # vLLM's own (silent) double free
    assert block.ref_cnt == -1


class _Recording(type):
    """Records every method assigned on the class."""

    log: list[tuple[str, Any]]

    def __setattr__(cls, name: str, value: Any) -> None:
        cls.__dict__.get("log", []).append((name, value))
        super().__setattr__(name, value)


@pytest.mark.cython
def test_switching_twins_never_puts_vllms_method_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvqueue.vllm as kv_vllm

    block_pool = _vllm_modules(monkeypatch)
    cls = pool_class(NEWEST, module=block_pool, metaclass=_Recording)
    type.__setattr__(cls, "log", [])
    block_pool.BlockPool = cls
    vllms = {name: cls.__dict__[name] for name in NEWEST.pool_methods}
    kv_vllm.uninstall()
    try:
        for implementation in ("python", "cython", "python", "cython"):
            kv_vllm.install(implementation)
        assigned = [value for name, value in vars(cls)["log"] if name in vllms]
        assert len(assigned) == 4 * len(vllms)
        assert all(_pool_guard._ours(value) is not None for value in assigned)
    finally:
        kv_vllm.uninstall()
    assert {name: cls.__dict__[name] for name in vllms} == vllms


def _vllm_modules(monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's module tree, as far as install() reads it, with a pool of the newest line."""
    utils_name, pool_name = vllm_stubs.UTILS, vllm_stubs.POOL
    modules = {
        "vllm": ModuleType("vllm"),
        "vllm.v1": ModuleType("vllm.v1"),
        "vllm.v1.core": ModuleType("vllm.v1.core"),
        utils_name: ModuleType(utils_name),
        pool_name: ModuleType(pool_name),
        vllm_stubs.MANAGER: vllm_stubs.manager_module(),
    }
    modules["vllm"].__version__ = NEWEST.release  # type: ignore[attr-defined]
    modules[utils_name].KVCacheBlock = block_class(NEWEST)  # type: ignore[attr-defined]
    modules[utils_name].FreeKVCacheBlockQueue = vllm_stubs.VllmQueue  # type: ignore[attr-defined]
    modules[pool_name].FreeKVCacheBlockQueue = vllm_stubs.VllmQueue  # type: ignore[attr-defined]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules[pool_name]


# --- item 4: one walk per repair call ------------------------------------------------------


_REF_CNT_SLOT: Any = VllmStyleBlock.__dict__["ref_cnt"]


class _CountedBlock(VllmStyleBlock):
    """Counts the reads of its ``ref_cnt`` (a property over the slot)."""

    __slots__ = ()
    reads = 0

    @property
    def ref_cnt(self) -> Any:
        _CountedBlock.reads += 1
        return _REF_CNT_SLOT.__get__(self)

    @ref_cnt.setter
    def ref_cnt(self, value: Any) -> None:
        _REF_CNT_SLOT.__set__(self, value)


def test_repairing_many_blocks_in_one_call_is_one_walk(queue_mod: ModuleType, quiet: Any) -> None:
    n = 600
    cls = pool_class(NEWEST, block=_CountedBlock)
    found = _pool_guard.guard(cls, screen_of(queue_mod), policy_of, wrap_foreign=False, line=NEWEST)
    try:
        pool = make_pool(cls, queue_mod, n + 1, "repair")
        free = pool.free_block_queue.get_all_free_blocks()
        for block in free[::2]:
            block.ref_cnt = -1
        _CountedBlock.reads = 0
        assert len(pool.get_new_blocks(n)) == n
        # The screen's walk, the repair's walk and vLLM's own assert and increment: a few
        # reads per block, where a walk per repaired block made it n * n / 4.
        assert _CountedBlock.reads <= 6 * n
        assert _pool_guard.pool_repairs(pool)["negative_ref"] == n // 2
        consistent(pool)
    finally:
        _pool_guard.unguard(cls, found)


# --- item 12: code run in the middle of a screen ---------------------------------------------

POOL = object()


class _Slotted:
    __slots__ = ("is_null", "next_free_block", "pool", "prev_free_block", "ref_cnt")

    def __init__(self, ref_cnt: Any) -> None:
        self.ref_cnt = ref_cnt
        self.is_null = False
        self.pool = POOL
        self.prev_free_block = self.next_free_block = None


class _Switched(_Slotted):
    __slots__ = ()
    ref_cnt = property(lambda self: 0)


class _SwitchOnTruth:
    """An ``is_null`` whose truth gives its block another class."""

    def __init__(self, block: Any) -> None:
        self.block = block

    def __bool__(self) -> bool:
        self.block.__class__ = _Switched
        return False


def test_a_class_switched_mid_screen_is_read_as_switched(screen: ModuleType) -> None:
    block: Any = _Slotted(1)
    block.is_null = _SwitchOnTruth(block)
    assert screen.first_excess([block], POOL) == 0  # its ref_cnt now reads 0


class _Counting:
    """A class-level ``ref_cnt`` that counts who reads it."""

    def __init__(self) -> None:
        self.reads: list[bool] = []

    def __get__(self, instance: Any, owner: Any) -> int:
        self.reads.append(instance is None)
        return 1


def test_a_class_level_descriptor_runs_only_for_the_block(screen: ModuleType) -> None:
    descriptor = _Counting()

    class Described:
        __slots__ = ("is_null", "next_free_block", "pool", "prev_free_block")
        ref_cnt = descriptor

    block: Any = Described()
    block.is_null, block.pool, block.prev_free_block = False, POOL, None
    assert screen.first_excess([block], POOL) == -1
    assert descriptor.reads == [False]


class _Appending(_Slotted):
    """A block whose ``is_null`` read appends a block to the list being screened."""

    __slots__ = ("victim",)
    victim: list[Any]

    @property
    def is_null(self) -> bool:
        self.victim.append(_Slotted(0))
        return False

    @is_null.setter
    def is_null(self, value: bool) -> None:
        pass


def test_blocks_appended_mid_screen_are_not_screened(screen: ModuleType) -> None:
    blocks: list[Any] = [_Slotted(1)]
    appending: Any = _Appending(1)
    appending.victim = blocks
    blocks.append(appending)
    assert screen.first_excess(blocks, POOL) == -1
    assert len(blocks) == 3


# --- item 15: vLLM's own message for remove() --------------------------------------------


def _vllms_block_class(of: Line) -> type:
    cls = type(block_class(of).__name__, (block_class(of),), {"__slots__": ()})
    cls.__module__ = "vllm.v1.core.kv_cache_utils"
    cls.__qualname__ = cls.__name__ = "KVCacheBlock"
    return cls


def test_remove_of_an_invalid_block_says_what_vllm_says(queue_mod: ModuleType) -> None:
    # Every layout: 0.18-0.23 (no token count), 0.24-0.33 (private hash fields), 0.34+ (public).
    for of in LINES:
        cls = _vllms_block_class(of)
        blocks = [cls(i) for i in range(3)]
        queue = queue_mod.FreeKVCacheBlockQueue(blocks)
        queue.popleft()
        blocks[0].ref_cnt = 2
        hash_field = of.block_fields[3 if of.has_pool_field else 2]
        assert hash_field.endswith("block_hash")
        setattr(blocks[0], hash_field, b"\x01h")
        tokens = f"{hash_field}_num_tokens"
        tokens = f"{tokens}=None, " if tokens in of.block_fields else ""
        with pytest.raises(RuntimeError) as info:
            queue.remove(blocks[0])
        assert str(info.value) == (
            "remove() called on an invalid block: KVCacheBlock(block_id=0, ref_cnt=2, "
            f"{hash_field}=b'\\x01h', {tokens}prev_free_block=None, next_free_block=None)"
        )
    own = [KVCacheBlock(i) for i in range(3)]
    queue = queue_mod.FreeKVCacheBlockQueue(own[1:])
    own[0].next_free_block = own[2]  # an invalid block: one link, not in the list
    with pytest.raises(RuntimeError) as info:
        queue.remove(own[0])
    assert str(info.value) == (
        "remove() called on an invalid block: KVCacheBlock(block_id=0, ref_cnt=0, "
        "_block_hash=None, _block_hash_num_tokens=None, prev_free_block=None, "
        "next_free_block=2)"
    )


def test_other_classes_keep_the_bounded_name(queue_mod: ModuleType) -> None:
    blocks = [VllmStyleBlock(i) for i in range(2)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks[1:])
    with pytest.raises(RuntimeError) as info:
        queue.remove(blocks[0])
    assert str(info.value) == "remove() called on an invalid block: VllmStyleBlock(block_id=0)"


# --- items 1 and 2, and what else may crash or hang: each in its own process -------------


@pytest.mark.parametrize("case", ISOLATED_CASES)
def test_isolated_guard_case(case: str, queue_mod: ModuleType) -> None:
    done = run_isolated("guard_cases", case, queue_mod.__name__)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stderr == "", done.stderr[-4000:]
