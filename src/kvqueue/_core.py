"""What both twins share, importing neither: how their arguments are parsed, which
blocks and pools a queue takes, and how an assigned count is validated. A twin's own
module holds only how it threads the list; how anything is named in a message is
``_errors``'.

Everything here that reads a block or its class runs no Python code of theirs
(no ``__repr__``, property, ``__index__`` of a block or metaclass hook), so a
twin may call it between reading its state and writing it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from operator import index
from types import MemberDescriptorType
from typing import Any, TypeVar

from . import _errors, _policy
from ._block import check_block_type, is_block, lookup

__all__ = (
    "as_sequence",
    "common_pool",
    "constructor_arguments",
    "count",
    "first_block_type",
    "gate",
    "link_misuse",
)

T = TypeVar("T")


def constructor_arguments(
    self: object, blocks: Any, *, block_type: Any = None, on_misuse: Any = None
) -> tuple[Any, Any, Any]:
    return blocks, block_type, on_misuse


# Named as the pure twin's __init__: the compiled twin parses its arguments with
# it, so a wrong call gets the interpreter's own message, worded as on that twin.
constructor_arguments.__qualname__ = "FreeKVCacheBlockQueue.__init__"
constructor_arguments.__name__ = "__init__"


def as_sequence(blocks: Iterable[T], method: str) -> list[T] | tuple[T, ...]:
    """``blocks`` as a list or tuple, as C's ``PySequence_Fast`` gives it.

    Any other iterable is materialized before the first link is touched, so
    that its side effects cannot run in the middle of an update.
    """
    if type(blocks) is list or type(blocks) is tuple:
        return blocks
    try:
        iterator = iter(blocks)
    except TypeError:
        raise _errors.not_iterable(method) from None
    return list(iterator)


def first_block_type(blocks: Sequence[Any]) -> type:
    """The class of ``blocks[0]``, if the queue can thread it; else TypeError naming it."""
    block_type = type(blocks[0])
    try:
        return check_block_type(block_type)
    except TypeError as exc:
        raise _errors.not_a_first_block(block_type, exc) from None


def common_pool(block_type: type, blocks: Sequence[Any]) -> object:
    """The ``pool`` all ``blocks`` share, or None: it binds the queue to that pool.

    Read through ``block_type``'s slot, never a block's own attribute; a block the
    queue cannot thread unbinds it (the build then refuses that block anyway).
    """
    slot = lookup(block_type, "pool")
    if not blocks or type(slot) is not MemberDescriptorType:
        return None
    pool = None
    for block in blocks:
        if not is_block(block, block_type):
            return None
        try:
            block_pool = slot.__get__(block, block_type)
        except AttributeError:
            return None
        if block_pool is None or (pool is not None and block_pool is not pool):
            return None
        pool = block_pool
    return pool


def count(value: object) -> int:
    """``value`` as a new ``num_free_blocks``: an int from 0 to ``sys.maxsize``."""
    try:
        num = int.__index__(index(value))  # type: ignore[arg-type]
    except TypeError:
        raise _errors.count_not_an_integer(value) from None
    if not 0 <= num <= sys.maxsize:
        raise _errors.count_out_of_range(num)
    return num


def link_misuse(
    block: object, batch: Sequence[object], position: int, linked: bool, sentinels: tuple[Any, Any]
) -> _policy.QueueMisuse:
    """Which misuse stopped a batch at ``batch[position]`` (a block of the queue's
    class): one of ``_policy.QUEUE_MISUSES``. ``linked``: the block has a link now,
    with this call's own links undone."""
    if block is sentinels[0] or block is sentinels[1]:
        return "sentinel"
    if any(block is other for other in batch[:position]):
        return "duplicate"
    return "linked" if linked else "other_pool"


def gate(value: object) -> Any:
    """``value`` as a queue's gate: None or a callable; raises TypeError for anything else."""
    if value is not None and not callable(value):
        raise TypeError(f"a queue's gate is None or a callable, not {type(value).__qualname__}")
    return value
