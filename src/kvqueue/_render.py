"""How a block or a value appears in kvqueue's messages, without running its code.

An object appears in a message only as :func:`describe` gives it, never through its own
``repr``; nothing here runs Python code of a block or its class (no ``__repr__``,
property, ``__index__`` or metaclass hook), so a twin may build a message between reading
its state and writing it. :func:`vllm_repr` gives vLLM's own repr of its block, which
vLLM's messages carry, built from the slots.
"""

from __future__ import annotations

import re
import textwrap
from types import MemberDescriptorType, NoneType
from typing import Any

from . import _block
from ._block import KVCacheBlock, lookup

_qualname = type.__dict__["__qualname__"].__get__
_namespace = type.__dict__["__dict__"].__get__
_BOUND = slice(0, 80)
# Where vLLM defines its block class; the fields its __repr__ shows (every line has the
# same __repr__ but 0.18-0.23, whose blocks lack _block_hash_num_tokens and so its field, and
# 0.34+, whose hash fields are public slots: block_hash, block_hash_num_tokens).
_VLLM_BLOCK_MODULE = "vllm.v1.core.kv_cache_utils"
_REPR_FIELDS = ("block_id", "ref_cnt", "_block_hash", "_block_hash_num_tokens")
_REPR_FIELDS_034 = ("block_id", "ref_cnt", "block_hash", "block_hash_num_tokens")
_REPR_LINKS = ("prev_free_block", "next_free_block")
# A hash longer than any vLLM makes is not printed whole.
_HASH_BOUND = 1024
#: The widest line of a message of kvqueue's, with what a traceback prints before its first.
WIDTH = 100
# A line break that starts a paragraph, and one that a wrapped paragraph goes on after.
_PARAGRAPH = re.compile(r"\n(?!  )")
_GOES_ON = re.compile(r"\n  +")
# A line break and the indent after it, as wrap() makes them.
_BREAK = re.compile(r"\n *")


def number(n: int) -> str:
    """An int for a message: no subclass ``__format__``, no 4,300-digit limit to hit."""
    if -(10**30) < n < 10**30:
        return int.__repr__(n)
    return f"an integer of {int.bit_length(n)} bits"


def times(n: int) -> str:
    """``n`` times, worded: "once", "2 times"."""
    return "once" if n == 1 else f"{number(n)} times"


def plural(n: int, noun: str) -> str:
    """``n`` of ``noun``, worded: "1 reference", "2 references"."""
    return f"{number(n)} {noun}" if n == 1 else f"{number(n)} {noun}s"


def describe(obj: object) -> str:
    """``obj`` for a message, bounded, and without calling anything of its own: a
    block's ``__repr__`` may walk the links (vLLM's dataclass does) or raise."""
    cls = type(obj)
    name = type_name(cls)
    if cls is NoneType or cls is bool or cls is float:
        return f"{name} {obj!r}"
    if cls is int:
        return f"{name} {number(obj)}"  # type: ignore[arg-type]
    if cls is str:
        return f"{name} {str.__repr__(str.__getitem__(obj, _BOUND))}"  # type: ignore[index]
    found = block_id(obj)
    if found is not None:
        return f"{name}(block_id={number(found)})"
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
    public = type(lookup(cls, "block_hash")) is MemberDescriptorType
    names = _REPR_FIELDS_034 if public else _REPR_FIELDS
    for name in names:
        slot = lookup(cls, name)
        if slot is _block.MISSING and name == names[3]:
            continue
        shown = _shown(_slot_value(obj, cls, slot), name == names[2])
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


def wrap(text: str, lead: int = 0) -> str:
    """``text`` in lines of at most :data:`WIDTH` columns, the first after ``lead`` columns
    that something else prints before it (an exception's type); a paragraph's further lines
    indented by two, its own line breaks kept. ``text`` itself when every line fits already.
    A word longer than a line (a path) is not broken. A paragraph wrapped already (an
    exception's message in a log record) flows again as one: a line indented by two goes on
    the line before it. O(len(text))."""
    first = WIDTH - lead
    if all(len(line) <= (first if n == 0 else WIDTH) for n, line in enumerate(text.split("\n"))):
        return text
    lines: list[str] = []
    for paragraph in _PARAGRAPH.split(text):
        indent = " " * max(lead, 0)
        wrapped = textwrap.wrap(
            _GOES_ON.sub(" ", paragraph),
            WIDTH,
            initial_indent=indent,
            subsequent_indent="  ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        lines += [wrapped[0][len(indent) :], *wrapped[1:]] if wrapped else [""]
        lead = 0
    return "\n".join(lines)


def one_line(text: object) -> str:
    """``text`` (a message, an exception) as one line, word for word, for what a program reads
    (JSON, a metric's label): each line break of :func:`wrap`'s, a paragraph's or a wrapped
    line's, and the indent after it read as the one space it replaced. O(len(text))."""
    return _BREAK.sub(" ", str(text))


def type_name(cls: type) -> str:
    return str.__getitem__(_qualname(cls), _BOUND)
