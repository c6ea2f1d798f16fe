"""The twins look the same to every tool: names, signatures, docstrings,
subscription, copying, pickling and argument errors.

Each test compares the compiled twin with the pure one directly, so a
difference fails whichever side moved.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import pydoc
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from kvqueue import KVCacheBlock

from support.helpers import check_queue, one_line, raises_said, snapshot
from support.twins import both as both_twins

# The tests that compare the two twins side by side need the compiled one.
both = pytest.mark.cython


@pytest.fixture(scope="module")
def twins() -> tuple[type, type]:
    compiled_mod, pure_mod = both_twins()
    return compiled_mod.FreeKVCacheBlockQueue, pure_mod.FreeKVCacheBlockQueue


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


# The protocol methods a user can reach (len(), iter(), repr(), copy, Q[B]).
DUNDERS = ("__iter__", "__len__", "__repr__", "__reduce_ex__", "__class_getitem__")


def _parameters(obj: Any) -> list[tuple[str, Any, Any]]:
    # Annotations are left out: a builtin's text signature cannot carry them.
    return [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()]


def _doc(obj: Any) -> str:
    return " ".join((inspect.getdoc(obj) or "").split())


@both
def test_same_public_names(twins: tuple[type, type]) -> None:
    compiled, pure = twins
    assert _public(compiled) == _public(pure)
    for name in DUNDERS:
        # Defined by each twin (or, for the pure one's subscription, by Generic), not
        # object's default.
        for cls in twins:
            assert getattr(cls, name, None) not in (None, getattr(object, name, None)), name


@both
def test_same_signatures(twins: tuple[type, type]) -> None:
    compiled, pure = twins
    assert _parameters(compiled) == _parameters(pure)
    for name in sorted(_public(pure)):
        if callable(getattr(pure, name)):
            assert _parameters(getattr(compiled, name)) == _parameters(getattr(pure, name)), name
    # The protocol methods, bound (a slot wrapper's self is positional-only, a function's
    # is not): what a caller passes them.
    queues = compiled([]), pure([])
    for name in ("__iter__", "__len__", "__repr__", "__reduce_ex__"):
        bound = [_parameters(getattr(queue, name)) for queue in queues]
        assert bound[0] == bound[1], name


@both
def test_same_docstrings(twins: tuple[type, type]) -> None:
    compiled, pure = twins
    assert _doc(compiled) == _doc(pure)
    for name in sorted(_public(pure)):
        assert _doc(getattr(compiled, name)) == _doc(getattr(pure, name)), name
        assert _doc(getattr(pure, name)), f"{name} has no docstring"


@both
def test_help_shows_signatures_and_no_internals(twins: tuple[type, type]) -> None:
    compiled, _ = twins
    text = pydoc.plain(pydoc.render_doc(compiled))
    assert "__pyx" not in text
    assert "popleft_n(self, n, /)" in text
    assert "FreeKVCacheBlockQueue(blocks, *, block_type=None, on_misuse=None)" in text


def test_subscription_gives_a_usable_alias(queue_mod: ModuleType) -> None:
    queue_class = queue_mod.FreeKVCacheBlockQueue
    alias = queue_class[KVCacheBlock]
    assert alias.__origin__ is queue_class
    assert alias.__args__ == (KVCacheBlock,)
    queue = alias([KVCacheBlock(0)])
    assert type(queue) is queue_class
    assert len(queue) == 1


def _round_trip(protocol: int) -> Callable[[Any], Any]:
    return lambda obj: pickle.loads(pickle.dumps(obj, protocol))


# The one table of copies: a queue refuses each, a block comes back detached.
CLONERS: dict[str, Callable[[Any], Any]] = {
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    **{f"pickle{p}": _round_trip(p) for p in range(pickle.HIGHEST_PROTOCOL + 1)},
}


@pytest.mark.parametrize("policy", ["raise", "repair"])
@pytest.mark.parametrize("how", CLONERS)
def test_a_queue_refuses_to_be_copied(queue_mod: ModuleType, how: str, policy: str) -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks, on_misuse=policy)
    before = snapshot(queue, blocks)
    with raises_said(TypeError, "cannot be copied or pickled"):
        CLONERS[how](queue)
    assert snapshot(queue, blocks) == before


@pytest.mark.parametrize("how", CLONERS)
def test_a_copied_block_is_detached(queue_mod: ModuleType, how: str) -> None:
    blocks = [KVCacheBlock(i, ref_cnt=i, pool="pool-1") for i in range(3)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks)
    blocks[1].set_block_hash("h", 16)
    blocks[1].is_null = True
    before = snapshot(queue, blocks)
    clone = CLONERS[how](blocks[1])
    assert type(clone) is KVCacheBlock
    assert clone is not blocks[1]
    fields = ("block_id", "ref_cnt", "_block_hash", "_block_hash_num_tokens", "pool", "is_null")
    assert [getattr(clone, f) for f in fields] == [1, 1, "h", 16, "pool-1", True]
    assert clone.prev_free_block is None
    assert clone.next_free_block is None
    assert snapshot(queue, blocks) == before
    if how.startswith("pickle"):
        # Its pool is a copy too: the queue bound to the original's refuses it.
        with raises_said(ValueError, "another pool"):
            queue.append(clone)
        assert snapshot(queue, blocks) == before
        return
    # The clone is a free block of its own: it can join the queue the original is in.
    queue.append(clone)
    check_queue(queue, [*blocks, clone], [*blocks, clone])


CALLS: dict[str, Callable[[type], object]] = {
    "no blocks": lambda cls: cls(),
    "unknown keyword": lambda cls: cls([], colour=1),
    "positional block_type": lambda cls: cls([], KVCacheBlock),
    "popleft_n()": lambda cls: cls([]).popleft_n(),
    "popleft_n(n=1)": lambda cls: cls([]).popleft_n(n=1),
    "remove(block=)": lambda cls: cls([]).remove(block=KVCacheBlock(0)),
    "popleft(1)": lambda cls: cls([]).popleft(1),
    "append_n(a, b)": lambda cls: cls([]).append_n([], []),
}


def _error(call: Callable[[type], object], cls: type) -> BaseException:
    try:
        call(cls)
    except BaseException as exc:
        return exc
    raise AssertionError("no exception")


@both
@pytest.mark.parametrize("call", CALLS)
def test_argument_errors_match(twins: tuple[type, type], call: str) -> None:
    compiled, pure = twins
    compiled_error = _error(CALLS[call], compiled)
    pure_error = _error(CALLS[call], pure)
    assert type(compiled_error) is type(pure_error) is TypeError
    if call.startswith(("no blocks", "unknown", "positional")):
        # The constructor's arguments are parsed by the same function on both.
        assert str(compiled_error) == str(pure_error)
    else:
        # A method's: by the interpreter, for a builtin or for a function.
        # Both messages name the method the same way.
        name = "FreeKVCacheBlockQueue." + call.split("(")[0] + "()"
        assert str(compiled_error).startswith(name), compiled_error
        assert str(pure_error).startswith(name), pure_error


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        ([1, 2], "FreeKVCacheBlockQueue(): blocks[0] has type int, which the queue cannot thread"),
        ([KVCacheBlock(0), "x"], "FreeKVCacheBlockQueue(): expected a KVCacheBlock, got str 'x'"),
    ],
)
def test_constructor_errors_name_the_bad_element(
    queue_mod: ModuleType, blocks: list[Any], message: str
) -> None:
    with pytest.raises(TypeError) as info:
        queue_mod.FreeKVCacheBlockQueue(blocks)
    assert one_line(info.value).startswith(message)
