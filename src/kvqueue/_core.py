"""What both twins share, importing neither: how arguments are parsed, which
blocks and pools a queue takes, how a count is validated and how a block is
named in a message. A twin's own module holds only how it threads the list.

Everything here that reads a block or its class runs no Python code of theirs
(no ``__repr__``, property, ``__index__`` of a block or metaclass hook), so a
twin may call it between reading its state and writing it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from operator import index
from types import MemberDescriptorType, NoneType
from typing import Any, TypeVar

from . import _block, _errors
from ._block import KVCacheBlock, check_block_type, is_block, is_subtype, layout_change, lookup

__all__ = (
    "as_sequence",
    "block_id",
    "common_pool",
    "constructor_arguments",
    "count",
    "describe",
    "first_block_type",
    "link_misuse",
    "misuse",
    "not_a_block",
    "vllm_repr",
)

T = TypeVar("T")

_qualname = type.__dict__["__qualname__"].__get__
_namespace = type.__dict__["__dict__"].__get__
_BOUND = slice(0, 80)
# Where vLLM defines its block class; the fields its __repr__ shows (every line has the
# same __repr__ but 0.23, whose blocks lack _block_hash_num_tokens and so its field).
_VLLM_BLOCK_MODULE = "vllm.v1.core.kv_cache_utils"
_REPR_FIELDS = ("block_id", "ref_cnt", "_block_hash", "_block_hash_num_tokens")
_REPR_LINKS = ("prev_free_block", "next_free_block")
# A hash longer than any vLLM makes is not printed whole.
_HASH_BOUND = 1024


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
        raise _errors.not_a_first_block(_name(block_type), exc) from None


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
        raise _errors.count_not_an_integer(_name(type(value))) from None
    if not 0 <= num <= sys.maxsize:
        raise _errors.count_out_of_range(num)
    return num


def describe(obj: object) -> str:
    """``obj`` for a message, bounded, and without calling anything of its own: a
    block's ``__repr__`` may walk the links (vLLM's dataclass does) or raise."""
    cls = type(obj)
    name = _name(cls)
    if cls is NoneType or cls is bool or cls is float:
        return f"{name} {obj!r}"
    if cls is int:
        return f"{name} {_errors.number(obj)}"  # type: ignore[arg-type]
    if cls is str:
        return f"{name} {str.__repr__(str.__getitem__(obj, _BOUND))}"  # type: ignore[index]
    found = block_id(obj)
    if found is not None:
        return f"{name}(block_id={_errors.number(found)})"
    return f"{name} object at {id(obj):#x}"


def block_id(obj: object) -> int | None:
    """``obj``'s ``block_id`` read from its class's slot, if that is an int; no code of
    the object's or its class's runs."""
    cls = type(obj)
    value = _slot_value(obj, cls, lookup(cls, "block_id"))
    return value if type(value) is int else None


def vllm_repr(obj: object) -> str | None:
    """What vLLM's ``KVCacheBlock.__repr__`` returns for ``obj``, a block of vLLM's own
    class or of kvqueue's, built from the class's slots: the block's own ``__repr__``
    (which reads the neighbours' ``block_id``) does not run. None for another class, or
    for a field vLLM's repr would print through code of its own (bounded: ``describe``).
    """
    cls = type(obj)
    if cls is not KVCacheBlock and (
        _namespace(cls).get("__module__") != _VLLM_BLOCK_MODULE or _qualname(cls) != "KVCacheBlock"
    ):
        return None
    parts = []
    for name in _REPR_FIELDS:
        slot = lookup(cls, name)
        if slot is _block.MISSING and name == "_block_hash_num_tokens":
            continue
        shown = _shown(_slot_value(obj, cls, slot), name == "_block_hash")
        if shown is None:
            return None
        parts.append(f"{name}={shown}")
    for name in _REPR_LINKS:
        link = _slot_value(obj, cls, lookup(cls, name))
        if link is None:
            parts.append(f"{name}=None")
            continue
        if link is _block.MISSING:
            return None
        # vLLM prints the neighbour's block_id; a neighbour of another class may run code.
        link_cls = type(link)
        if link_cls is not cls:
            return None
        shown = _shown(_slot_value(link, cls, lookup(cls, "block_id")), False)
        if shown is None:
            return None
        parts.append(f"{name}={shown}")
    return f"KVCacheBlock({', '.join(parts)})"


def _slot_value(obj: object, cls: type, slot: Any) -> Any:
    if type(slot) is not MemberDescriptorType:
        return _block.MISSING
    try:
        return slot.__get__(obj, cls)
    except (AttributeError, TypeError):
        return _block.MISSING


def _shown(value: Any, as_repr: bool) -> str | None:
    """``value`` as vLLM's f-string shows it (``{}``, or ``{!r}`` for the hash), for the
    types vLLM stores there; None for others."""
    if value is None:
        return "None"
    cls = type(value)
    if cls is int and -(10**30) < value < 10**30:
        return int.__repr__(value)
    if as_repr and cls is bytes and len(value) <= _HASH_BOUND:
        return bytes.__repr__(value)
    return None


def not_a_block(obj: object, block_type: type, where: str) -> TypeError:
    why = ""
    if is_subtype(type(obj), block_type):
        changed = layout_change(type(obj), block_type)
        why = (
            f", whose class redefines {changed} (the queue reads and writes "
            f"{_name(block_type)}'s own)"
        )
    return _errors.not_a_block(describe(obj), _name(block_type), where, why)


def corrupted(where: str, obj: object) -> RuntimeError:
    return _errors.corrupted(where, describe(obj))


def link_misuse(
    block: object, batch: Sequence[object], position: int, linked: bool, sentinels: tuple[Any, Any]
) -> str:
    """Which misuse stopped a batch at ``batch[position]`` (a block of the queue's
    class): the kind ``_policy.KINDS`` names. ``linked``: the block has a link now,
    with this call's own links undone."""
    if block is sentinels[0] or block is sentinels[1]:
        return "sentinel"
    if any(block is other for other in batch[:position]):
        return "duplicate"
    return "linked" if linked else "other_pool"


def misuse(method: str, kind: str, block: object) -> Exception:
    """What a misuse of ``kind`` raises under ``"raise"``. The one vLLM raises too,
    ``remove()`` of a block that is not linked, names a block of vLLM's class or
    kvqueue's as vLLM does."""
    described = (vllm_repr(block) if kind == "not_linked" else None) or describe(block)
    return _errors.misuse(method, kind, described)


def _name(cls: type) -> str:
    return str.__getitem__(_qualname(cls), _BOUND)
