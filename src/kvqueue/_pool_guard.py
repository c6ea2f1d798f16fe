"""The pool guard: vLLM's ``BlockPool`` methods that move reference counts, checked first.

A double free that never reaches a queue call (vLLM issue 42571: one block twice in
one ``free_blocks()`` call takes its ``ref_cnt`` 1, 0, -1 and links it once) is seen
here, where the count moves. Each guarded method screens its arguments (the twins
``_screen.pyx`` / ``_screen_py.py``: read only, O(blocks)), then calls vLLM's own
method, so the guard follows whatever the installed vLLM does:

* ``free_blocks`` / ``unpin_blocks``: a block given more times than it holds
  references (its ``ref_cnt`` would go below 0), or linked in the free list already,
  is a double free;
* ``touch``: a block whose ``ref_cnt`` is negative already (a double free that
  happened unguarded) would come back to 0 while still linked as free;
* ``get_new_blocks``: a block about to be handed out whose ``ref_cnt`` is not 0.

The pool's misuse policy is its queue's (``on_misuse``), else the policy given to
``install()``. ``"raise"``: ValueError naming the block, the pool and the call, before
anything changes. ``"repair"``: the excess occurrences are dropped (a negative count
is taken as 0, a held block is unlinked rather than handed out), the rest is done by
vLLM's own method, and the repair is counted per pool and logged on the queue's
logger under the queue's rate limit. Only a pool's own blocks are checked: null
blocks, another pool's blocks (``free_blocks`` routes them to their pool, whose guard
checks them) and blocks of no pool keep vLLM's handling.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import _policy

__all__ = ("GUARDED", "KINDS", "ForeignPatch", "guard", "originals", "pool_repairs", "unguard")

#: The methods guarded, in the order a request meets them.
GUARDED = ("get_new_blocks", "touch", "free_blocks", "unpin_blocks")

#: The pool repairs, by kind, with what each one did (the log line says it).
KINDS: dict[str, str] = {
    "double_free": "it was given more times than it holds references; the excess dropped",
    "negative_ref": "its ref_cnt was negative (an unguarded double free); taken as 0",
    "held_free": "it was in the free list while held; unlinked instead of handed out",
}

PolicyOf = Callable[[Any], _policy.MisusePolicy]

# Per pool, weakly: a pool's counters go with it.
_repairs: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()


class ForeignPatch(Exception):
    """A guarded method is not vLLM's own: another project replaced it."""

    def __init__(self, attribute: str, found: object) -> None:
        module = getattr(found, "__module__", None) or "an unknown module"
        name = getattr(found, "__qualname__", None) or type(found).__qualname__
        super().__init__(f"{attribute} is not vLLM's own: {module} replaced it with {name}")


def pool_repairs(pool: object) -> dict[str, int]:
    """The repairs the guard made on ``pool``, by kind (all 0 for a pool it never repaired)."""
    return dict(_repairs.get(pool) or dict.fromkeys(KINDS, 0))


def originals(pool_class: type, *, wrap_foreign: bool) -> dict[str, Any]:
    """The methods the guard would wrap, by name: vLLM's own (or what is there).

    Raises ForeignPatch if a method is neither vLLM's own nor kvqueue's guard, unless
    ``wrap_foreign``: then the guard wraps what is there.
    """
    found_methods: dict[str, Any] = {}
    for name in GUARDED:
        found = pool_class.__dict__.get(name)
        if found is None:
            continue
        own = f"{pool_class.__qualname__}.{name}"
        if getattr(found, "__kvqueue_guard__", False):
            found = found.__wrapped__
        elif not wrap_foreign and (
            getattr(found, "__module__", None) != pool_class.__module__
            or getattr(found, "__qualname__", None) != own
        ):
            raise ForeignPatch(f"{pool_class.__module__}.{own}", found)
        found_methods[name] = found
    return found_methods


def guard(
    pool_class: type, screen: ModuleType, policy_of: PolicyOf, *, wrap_foreign: bool, line: Any
) -> dict[str, Any]:
    """Replace each guarded method ``pool_class`` has with its guard; return the originals.
    Raises as :func:`originals` does, before it changes anything."""
    replaced = originals(pool_class, wrap_foreign=wrap_foreign)
    for name, original in replaced.items():
        setattr(pool_class, name, _WRAPPERS[name](original, screen, policy_of))
    return replaced


def unguard(pool_class: type, originals: dict[str, Any]) -> None:
    """Put back every original whose guard is still in place (a later patch is left)."""
    for name, original in originals.items():
        if getattr(pool_class.__dict__.get(name), "__wrapped__", None) is original:
            setattr(pool_class, name, original)


def _mark(original: Callable[..., Any], wrapper: Callable[..., Any]) -> Callable[..., Any]:
    functools.update_wrapper(wrapper, original)
    wrapper.__kvqueue_guard__ = True  # type: ignore[attr-defined]
    return wrapper


def _free_guard(original: Callable[..., Any], screen: ModuleType, policy_of: PolicyOf) -> Any:
    first_excess = screen.first_excess
    method = original.__name__

    def guarded(self: Any, blocks: Any, *args: Any, **kwargs: Any) -> Any:
        # vLLM iterates its argument once; a list made here is what it iterates,
        # so what was screened is what is freed.
        blocks = list(blocks)
        if first_excess(blocks, self) < 0:
            return original(self, blocks, *args, **kwargs)
        notes: list[_Note] = []
        blocks = _excess(self, blocks, method, policy_of(self), notes)
        return _then_log(notes, original, self, blocks, *args, **kwargs)

    return _mark(original, guarded)


def _touch_guard(original: Callable[..., Any], screen: ModuleType, policy_of: PolicyOf) -> Any:
    first_negative = screen.first_negative

    def touch(self: Any, blocks: Any, *args: Any, **kwargs: Any) -> Any:
        blocks = list(blocks)
        i = first_negative(blocks, self)
        if i < 0:
            return original(self, blocks, *args, **kwargs)
        notes: list[_Note] = []
        _negative(self, blocks, i, policy_of(self), notes)
        return _then_log(notes, original, self, blocks, *args, **kwargs)

    return _mark(original, touch)


def _alloc_guard(original: Callable[..., Any], screen: ModuleType, policy_of: PolicyOf) -> Any:
    first_held_free = screen.first_held_free

    def get_new_blocks(self: Any, num_blocks: Any, *args: Any, **kwargs: Any) -> Any:
        queue = self.free_block_queue
        # Asked for more than is free, or for no int: vLLM's own error, from vLLM.
        if type(num_blocks) is int and 0 < num_blocks <= queue.num_free_blocks:
            block = first_held_free(queue.fake_free_list_head, num_blocks)
            if block is not None:
                notes: list[_Note] = []
                _held_free(self, num_blocks, block, first_held_free, policy_of(self), notes)
                return _then_log(notes, original, self, num_blocks, *args, **kwargs)
        return original(self, num_blocks, *args, **kwargs)

    return _mark(original, get_new_blocks)


_WRAPPERS: dict[str, Callable[..., Any]] = {
    "free_blocks": _free_guard,
    "unpin_blocks": _free_guard,
    "touch": _touch_guard,
    "get_new_blocks": _alloc_guard,
}


def _excess(
    pool: Any,
    blocks: list[Any],
    method: str,
    policy: str,
    notes: list[_Note],
) -> list[Any]:
    """``blocks`` less the occurrences that release a reference the block does not hold.

    A block linked in the free list while it holds references (one was taken without
    ``touch()``) is unlinked under repair, so that vLLM's free links it once.
    """
    kept: list[Any] = []
    dropped: list[Any] = []
    linked: list[Any] = []
    given: dict[int, int] = {}
    left: dict[int, int] = {}
    for block in blocks:
        if block.pool is not pool or block.is_null:
            kept.append(block)
            continue
        key = id(block)
        if key not in left:
            left[key] = block.ref_cnt
            if block.prev_free_block is not None and block.ref_cnt > 0:
                linked.append(block)
        given[key] = given.get(key, 0) + 1
        (kept if left[key] > 0 else dropped).append(block)
        left[key] -= 1
    if policy == "raise":
        block = (dropped + linked)[0]
        if dropped:
            what = f"while it holds {block.ref_cnt} reference(s)"
        else:
            what = f"which is in the free list already (ref_cnt {block.ref_cnt})"
        raise ValueError(
            f"{_call(method)} was given block {block.block_id} {given[id(block)]} time(s) "
            f"{what}: a double free; nothing was freed. {_where(pool)}"
        )
    queue = pool.free_block_queue
    for block in linked:
        queue.remove(block)
        _repaired(pool, method, block, "held_free", notes)
    for block in dropped:
        _repaired(pool, method, block, "double_free", notes)
    return kept


def _negative(pool: Any, blocks: list[Any], first: int, policy: str, notes: list[_Note]) -> None:
    if policy == "raise":
        block = blocks[first]
        raise ValueError(
            f"{_call('touch')} was given block {block.block_id} whose ref_cnt is "
            f"{block.ref_cnt}: it was freed more times than it was referenced (a double "
            f"free), and a touch would count it free and held at once; nothing was "
            f"touched. {_where(pool)}"
        )
    for block in blocks[first:]:
        if block.pool is pool and not block.is_null and block.ref_cnt < 0:
            block.ref_cnt = 0
            _repaired(pool, "touch", block, "negative_ref", notes)


def _held_free(
    pool: Any,
    num_blocks: int,
    block: Any,
    first_held_free: Callable[[Any, int], Any],
    policy: str,
    notes: list[_Note],
) -> None:
    if policy == "raise":
        raise ValueError(
            f"{_call('get_new_blocks')} would hand out block {block.block_id}, which is in "
            f"the free list with ref_cnt {block.ref_cnt} (0 for a free block): a double free "
            f"made it both free and held; nothing was allocated. {_where(pool)}"
        )
    queue = pool.free_block_queue
    while block is not None:
        if block.ref_cnt > 0:
            queue.remove(block)
            _repaired(pool, "get_new_blocks", block, "held_free", notes)
        else:
            block.ref_cnt = 0
            _repaired(pool, "get_new_blocks", block, "negative_ref", notes)
        num_blocks = min(num_blocks, queue.num_free_blocks)
        block = first_held_free(queue.fake_free_list_head, num_blocks)


# A repair to log: (message arguments). Logged once vLLM's method has run, so that
# a logging handler that calls back into the pool finds it whole.
_Note = tuple[Any, ...]


def _repaired(pool: Any, method: str, block: Any, kind: str, notes: list[_Note]) -> None:
    counts = _repairs.get(pool)
    if counts is None:
        counts = _repairs[pool] = dict.fromkeys(KINDS, 0)
    counts[kind] += 1
    notes.append((_call(method), kind, counts[kind], block.block_id, KINDS[kind], _where(pool)))


def _then_log(notes: list[_Note], original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """vLLM's method, then the repairs' log lines (even if it raised)."""
    try:
        return original(*args, **kwargs)
    finally:
        _log(notes)


def _log(notes: list[_Note]) -> None:
    for note in notes:
        unlogged = _policy.admit()
        if unlogged is not None:
            _policy.logger.warning(
                "%s repaired a double free (%s #%d on this pool): block %s: %s. %s%s",
                *note,
                _policy.unlogged_note(unlogged),
            )


def _call(method: str) -> str:
    return f"BlockPool.{method}()"


def _where(pool: Any) -> str:
    """Which pool, and the caller of the guarded method (the code that misused it)."""
    # The first frame outside this file (whose guards are the methods called) is the caller.
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    site = "unknown"
    if frame is not None:
        # An installed package by its import path (vllm/v1/core/...), else the file's tail.
        path = frame.f_code.co_filename.replace("\\", "/")
        path = path.rpartition("-packages/")[2] or path
        site = f"{'/'.join(path.split('/')[-4:])}:{frame.f_lineno} in {frame.f_code.co_name}"
    blocks = getattr(pool, "num_gpu_blocks", "?")
    return f"Pool: BlockPool at {id(pool):#x} ({blocks} blocks); called from {site}"
