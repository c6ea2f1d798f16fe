"""The misuse policy: ``on_misuse="raise"`` keeps today's contract, ``"repair"``
skips exactly the bad blocks, links the rest, counts and logs each repair.

Every case of the invalid-operation table (invalid_ops.py) runs under both
policies; each case's data says what ``"repair"`` yields.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import pytest

from kvqueue import KVCacheBlock

from support.fuzz_common import detached, well_formed
from support.helpers import bound_queue, check_queue, one_line, snapshot
from support.invalid_ops import CASES, Repair, with_policy
from support.twins import both, twin

ENV = "KVQUEUE_ON_MISUSE"
POLICIES = ("raise", "repair")
KINDS = ("duplicate", "linked", "sentinel", "not_linked", "other_pool")
NONE_REPAIRED = dict.fromkeys(KINDS, 0)


def _records(log: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in log.records if r.name.startswith("kvqueue")]


def _position(blocks: list[Any], block: Any) -> int:
    return next(i for i, b in enumerate(blocks) if b is block)


def _links(blocks: Iterable[Any]) -> dict[int, tuple[int, int]]:
    return {id(b): (id(b.prev_free_block), id(b.next_free_block)) for b in blocks}


def _build(mod: ModuleType, n: int, **kwargs: Any) -> tuple[Any, list[Any]]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return mod.FreeKVCacheBlockQueue(blocks, **kwargs), blocks


# -- the invalid-operation table under both policies ------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(CASES))
def test_invalid_operation_under_each_policy(
    queue_mod: ModuleType, name: str, policy: str, repair_log: pytest.LogCaptureFixture
) -> None:
    setup, expected = CASES[name]
    queue, blocks, call = setup(with_policy(queue_mod, policy))
    assert queue.on_misuse == policy
    if policy == "repair" and expected.repair is not None:
        _check_repaired(queue, blocks, call, expected.repair, repair_log)
        return
    before = snapshot(queue, blocks)
    with pytest.raises(expected.exc) as info:
        call()
    assert type(info.value) is expected.exc
    message = one_line(info.value)
    if expected.exact:
        assert message == expected.message
    else:
        assert message.startswith(expected.message)
    assert snapshot(queue, blocks) == before, "the failing call changed the queue or a block"
    assert queue.repairs == NONE_REPAIRED
    assert _records(repair_log) == []


def _check_repaired(
    queue: Any,
    blocks: list[Any],
    call: Callable[[], object],
    repair: Repair,
    log: pytest.LogCaptureFixture,
) -> None:
    """The call returns; the queue it acted on holds ``repair.free`` and is well
    formed; nothing it held is lost; every other block and queue is untouched."""
    sentinels = [queue.fake_free_list_head, queue.fake_free_list_tail]
    held = queue.get_all_free_blocks()
    links = _links([*sentinels, *blocks])
    count = queue.num_free_blocks
    result = call()
    target: Any = result if type(result) is type(queue) else queue
    free = target.get_all_free_blocks()
    assert [_position(blocks, b) for b in free] == list(repair.free)
    check_queue(target, free, ())
    assert target.repairs == {**NONE_REPAIRED, **repair.kinds}
    changed = {id(b) for b in free}
    if target is queue:
        assert {id(b) for b in held} <= changed, "a repair lost a block"
        changed |= {id(b) for b in sentinels}
    else:
        assert queue.num_free_blocks == count
    rest = [b for b in [*sentinels, *blocks] if id(b) not in changed]
    assert _links(rest) == {key: links[key] for key in _links(rest)}
    records = _records(log)
    assert len(records) == sum(repair.kinds.values())
    assert all(f"{repair.call}()" in r.getMessage() for r in records)


# -- choosing the policy ------------------------------------------------------------


def test_the_default_policy_is_raise(
    queue_mod: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert queue_mod.FreeKVCacheBlockQueue([]).on_misuse == "raise"
    monkeypatch.setenv(ENV, "")
    assert queue_mod.FreeKVCacheBlockQueue([]).on_misuse == "raise"


def _double_free(queue: Any, blocks: list[Any]) -> str:
    """What a queue does with a block freed while linked: "raise" or "repair"."""
    try:
        queue.append(blocks[0])
    except ValueError:
        return "raise"
    return "repair"


@pytest.mark.parametrize("policy", POLICIES)
def test_the_argument_chooses_the_policy(
    queue_mod: ModuleType, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    queue, blocks = _build(queue_mod, 3, on_misuse=policy)
    assert queue.on_misuse == policy
    assert _double_free(queue, blocks) == policy
    check_queue(queue, blocks, blocks)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_environment_chooses_the_policy(
    queue_mod: ModuleType, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    monkeypatch.setenv(ENV, policy)
    queue, blocks = _build(queue_mod, 3)
    assert queue.on_misuse == policy
    assert _double_free(queue, blocks) == policy


def test_the_environment_is_read_when_a_queue_is_built(
    queue_mod: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "repair")
    repairing, blocks_a = _build(queue_mod, 3)
    monkeypatch.setenv(ENV, "raise")
    raising, blocks_b = _build(queue_mod, 3)
    monkeypatch.setenv(ENV, "bogus")  # read by neither built queue
    assert (repairing.on_misuse, raising.on_misuse) == ("repair", "raise")
    assert _double_free(repairing, blocks_a) == "repair"
    assert _double_free(raising, blocks_b) == "raise"


@pytest.mark.parametrize(
    ("variable", "argument"),
    [("repair", "raise"), ("raise", "repair"), ("bogus", "raise"), ("bogus", "repair")],
)
def test_the_argument_wins_over_the_environment(
    queue_mod: ModuleType, monkeypatch: pytest.MonkeyPatch, variable: str, argument: str
) -> None:
    monkeypatch.setenv(ENV, variable)
    queue, blocks = _build(queue_mod, 3, on_misuse=argument)
    assert queue.on_misuse == argument
    assert _double_free(queue, blocks) == argument


BAD_VARIABLES = ["bogus", "Repair", "RAISE", " repair", "repair ", "1", "none"]


@pytest.mark.parametrize("value", BAD_VARIABLES)
def test_an_unknown_environment_value_is_refused(
    queue_mod: ModuleType, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(ENV, value)
    blocks = [KVCacheBlock(i) for i in range(3)]
    with pytest.raises(ValueError, match=ENV) as info:
        queue_mod.FreeKVCacheBlockQueue(blocks)
    assert repr(value) in str(info.value)
    assert detached(blocks)


BAD_ARGUMENTS: list[object] = ["bogus", "Repair", "", " raise", 1, True, b"repair", ("repair",)]


@pytest.mark.parametrize("value", BAD_ARGUMENTS, ids=repr)
def test_an_unknown_argument_is_refused(
    queue_mod: ModuleType, monkeypatch: pytest.MonkeyPatch, value: object
) -> None:
    monkeypatch.setenv(ENV, "repair")
    blocks = [KVCacheBlock(i) for i in range(3)]
    with pytest.raises(ValueError, match="on_misuse") as info:
        queue_mod.FreeKVCacheBlockQueue(blocks, on_misuse=value)
    assert repr(value) in str(info.value)
    assert detached(blocks)


@pytest.mark.cython
def test_both_twins_refuse_a_policy_with_the_same_message(monkeypatch: pytest.MonkeyPatch) -> None:
    def refusals(mod: ModuleType) -> list[str]:
        messages = []
        for value in BAD_ARGUMENTS:
            with pytest.raises(ValueError, match="on_misuse") as info:
                mod.FreeKVCacheBlockQueue([], on_misuse=value)
            messages.append(str(info.value))
        for variable in BAD_VARIABLES:
            monkeypatch.setenv(ENV, variable)
            with pytest.raises(ValueError, match=ENV) as info:
                mod.FreeKVCacheBlockQueue([])
            messages.append(str(info.value))
        return messages

    compiled, pure = both()
    assert refusals(compiled) == refusals(pure)


def test_the_policy_is_a_keyword_only_argument(queue_mod: ModuleType) -> None:
    with pytest.raises(TypeError):
        queue_mod.FreeKVCacheBlockQueue([], None, "repair")


@pytest.mark.parametrize("policy", POLICIES)
def test_on_misuse_is_read_only(queue_mod: ModuleType, policy: str) -> None:
    queue, _ = _build(queue_mod, 2, on_misuse=policy)
    other = "raise" if policy == "repair" else "repair"
    with pytest.raises(AttributeError):
        queue.on_misuse = other
    with pytest.raises(AttributeError):
        del queue.on_misuse
    assert queue.on_misuse == policy


# -- the repair counters ------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_repairs_is_a_fresh_dict_with_every_kind(queue_mod: ModuleType, policy: str) -> None:
    queue, _ = _build(queue_mod, 2, on_misuse=policy)
    first = queue.repairs
    assert type(first) is dict
    assert first == NONE_REPAIRED
    assert all(type(v) is int for v in first.values())
    first["linked"] = 99
    first["invented"] = 1
    assert queue.repairs == NONE_REPAIRED
    assert queue.repairs is not queue.repairs
    with pytest.raises(AttributeError):
        queue.repairs = {}


def test_repairs_count_per_kind_and_old_snapshots_stay_as_they_were(
    queue_mod: ModuleType, repair_log: pytest.LogCaptureFixture
) -> None:
    queue, blocks = bound_queue(queue_mod, 4, "repair")
    stranger = KVCacheBlock(9, pool=object())
    popped = queue.popleft_n(2)
    before = queue.repairs
    queue.append(blocks[2])  # linked
    queue.append_n([popped[0], popped[0], queue.fake_free_list_tail])  # duplicate, sentinel
    queue.remove(popped[1])  # not_linked
    queue.remove(popped[1])  # not_linked
    queue.remove(stranger)  # other_pool
    assert before == NONE_REPAIRED
    expected = {"duplicate": 1, "linked": 1, "sentinel": 1, "not_linked": 2, "other_pool": 1}
    assert queue.repairs == expected
    assert list(queue.repairs) == list(before)
    check_queue(queue, [blocks[2], blocks[3], popped[0]], [*blocks, stranger])
    assert len(_records(repair_log)) == 6


# -- the repair log -----------------------------------------------------------------


def _misuse_of_kind(
    mod: ModuleType, kind: str, on_misuse: str = "repair"
) -> tuple[Any, Any, str, Callable[[], object]]:
    """(queue, the block a repair skips, the call's name, the call) for ``kind``."""
    pool = object()
    blocks = [KVCacheBlock(4240 + i, pool=pool) for i in range(4)]
    queue = mod.FreeKVCacheBlockQueue(blocks, on_misuse=on_misuse)
    freed = queue.popleft()
    if kind == "duplicate":
        return queue, freed, "append_n", lambda: queue.append_n([freed, freed])
    if kind == "linked":
        return queue, blocks[2], "append", lambda: queue.append(blocks[2])
    if kind == "sentinel":
        head = queue.fake_free_list_head
        return queue, head, "prepend_n", lambda: queue.prepend_n([freed, head])
    if kind == "not_linked":
        return queue, freed, "remove", lambda: queue.remove(freed)
    stranger = KVCacheBlock(4250, pool=object())
    mod.FreeKVCacheBlockQueue([stranger])
    return queue, stranger, "remove", lambda: queue.remove(stranger)


@pytest.mark.parametrize("kind", KINDS)
def test_a_repair_is_logged_with_the_call_the_block_and_what_was_skipped(
    queue_mod: ModuleType, kind: str, repair_log: pytest.LogCaptureFixture
) -> None:
    queue, block, call_name, call = _misuse_of_kind(queue_mod, kind)
    call()
    assert queue.repairs[kind] == 1
    (record,) = _records(repair_log)
    assert record.name == "kvqueue"
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert f"{call_name}()" in message
    assert f"block_id={block.block_id}" in message
    assert "skip" in message.lower()


@pytest.mark.parametrize("kind", KINDS)
def test_under_raise_the_same_misuse_logs_nothing(
    queue_mod: ModuleType, kind: str, repair_log: pytest.LogCaptureFixture
) -> None:
    queue, _, _, call = _misuse_of_kind(queue_mod, kind, "raise")
    with pytest.raises((ValueError, RuntimeError)):
        call()
    assert queue.repairs == NONE_REPAIRED
    assert _records(repair_log) == []


def test_a_hot_loop_of_repairs_is_logged_a_bounded_number_of_times(
    queue_mod: ModuleType, repair_log: pytest.LogCaptureFixture
) -> None:
    queue, blocks = _build(queue_mod, 8, on_misuse="repair")
    head = queue.fake_free_list_head
    for _ in range(2500):
        freed = queue.popleft()
        queue.remove(freed)  # not_linked
        queue.append_n([freed, freed])  # duplicate
        queue.append(freed)  # linked
        queue.prepend_n([head])  # sentinel
    assert queue.repairs == {
        **NONE_REPAIRED,
        "duplicate": 2500,
        "linked": 2500,
        "sentinel": 2500,
        "not_linked": 2500,
    }
    check_queue(queue, blocks[4:] + blocks[:4], blocks)
    assert 1 <= len(_records(repair_log)) <= 100


# -- a collection inside a repair ---------------------------------------------------


class _FreeOnCollect:
    """Cyclic garbage whose finalizer frees a block into the queue and takes
    the first one out (into ``taken``)."""

    def __init__(self, queue: Any, block: Any, taken: list[Any]) -> None:
        self.queue = queue
        self.block = block
        self.taken = taken
        self.me = self

    def __del__(self) -> None:
        self.queue.append(self.block)
        self.taken.append(self.queue.popleft())


@pytest.mark.cython
@pytest.mark.parametrize("method", ["append_n", "prepend_n"])
def test_a_collection_inside_a_repaired_batch_keeps_the_compiled_queue_whole(
    method: str, repair_log: pytest.LogCaptureFixture
) -> None:
    """The compiled twin is atomic under re-entrant collection (see
    hostile_cases.py); a repair allocates (its screening copy of the batch)
    before it links, so the collector can run a finalizer there that moves the
    ends of the list. 3.11 collects at the allocation itself."""
    mod = twin("cython")
    blocks = [KVCacheBlock(i) for i in range(40)]
    queue = mod.FreeKVCacheBlockQueue(blocks, on_misuse="repair")
    call = getattr(queue, method)  # a bound method is an allocation: made first
    threshold = gc.get_threshold()
    taken: list[Any] = []
    for round_ in range(5):
        popped = queue.popleft_n(2)
        batch = [popped[0], popped[0], popped[1]]
        gc.set_threshold(0)
        drained: list[Any] = [[] for _ in range(100)]
        _FreeOnCollect(queue, KVCacheBlock(100 + round_), taken)
        gc.set_threshold(1)
        try:
            call(batch)
        finally:
            gc.set_threshold(*threshold)
        del drained
        assert well_formed(queue) is None, well_formed(queue)
        # 3.12+ may collect only after the link, at the repair's logging call:
        # then the finalizer's popleft() takes a block the call just prepended.
        assert all(b.prev_free_block is not None or any(b is t for t in taken) for b in popped)


@pytest.mark.cython
def test_both_twins_log_a_repair_in_the_same_words(repair_log: pytest.LogCaptureFixture) -> None:
    for kind in KINDS:
        for mod in both():
            _misuse_of_kind(mod, kind)[3]()
    messages = [r.getMessage() for r in _records(repair_log)]
    assert len(messages) == 2 * len(KINDS)
    assert messages[0::2] == messages[1::2]
