"""How kvqueue names what went wrong: the exceptions both twins and the pool guard
raise, the misuses they repair, and how a block or argument appears in a message.

The messages of the errors vLLM raises are vLLM's, word for word: engines and
their tests match on them. An object appears in a message only as :func:`describe`
gives it, never through its own ``repr``; nothing here runs Python code of a block
or its class (no ``__repr__``, property, ``__index__`` or metaclass hook), so a
twin may build a message between reading its state and writing it.
"""

from __future__ import annotations

from types import MemberDescriptorType, NoneType
from typing import Any, Literal, get_args

from . import _block
from ._block import KVCacheBlock, is_subtype, layout_change, lookup

#: The misuses a queue repairs under ``"repair"`` (and refuses under ``"raise"``).
QueueMisuse = Literal["duplicate", "linked", "sentinel", "not_linked", "other_pool"]
#: What the holder audit finds at a scheduler step (and repairs under ``"repair"``): a
#: block a live request lists that is in the free list; one listed twice by one request
#: in one manager; one listed by two managers; one listed more times than its ``ref_cnt``.
AuditMisuse = Literal["listed_free", "listed_twice", "two_managers", "under_counted"]
#: The misuses the pool guard repairs, the holder audit's included.
PoolMisuse = Literal[
    "double_free",
    "negative_ref",
    "held_free",
    "listed_free",
    "listed_twice",
    "two_managers",
    "under_counted",
]
QUEUE_MISUSES: tuple[QueueMisuse, ...] = get_args(QueueMisuse)
POOL_MISUSES: tuple[PoolMisuse, ...] = get_args(PoolMisuse)
AUDIT_MISUSES: tuple[AuditMisuse, ...] = get_args(AuditMisuse)

#: What the repair of each misuse did (its log line says it).
REPAIRED: dict[QueueMisuse | PoolMisuse, str] = {
    "duplicate": "it appears more than once in the batch; linked once",
    "linked": "it is already linked into a free list; left where it is",
    "sentinel": "it is a sentinel of this queue; left where it is",
    "not_linked": "it is not linked; nothing removed",
    "other_pool": "it belongs to another pool's queue; left where it is",
    "double_free": "it was given more times than it holds references; the excess dropped",
    "negative_ref": "its ref_cnt was negative (an unguarded double free); taken as 0",
    "held_free": "it was in the free list while held; unlinked instead of handed out",
    "listed_free": "a live request lists it, but it was in the free list",
    "listed_twice": "one request lists it twice in one manager",
    "two_managers": "two managers list it",
    "under_counted": "it is listed more times than its ref_cnt",
}


class HolderAuditError(RuntimeError):
    """The holder audit found a block that a live request lists in the free list, or
    listed more times than it is held, before a scheduler step handed anything out."""


_qualname = type.__dict__["__qualname__"].__get__
_namespace = type.__dict__["__dict__"].__get__
_BOUND = slice(0, 80)
# Where vLLM defines its block class; the fields its __repr__ shows (every line has the
# same __repr__ but 0.23, whose blocks lack _block_hash_num_tokens and so its field, and
# 0.34+, whose hash fields are public slots: block_hash, block_hash_num_tokens).
_VLLM_BLOCK_MODULE = "vllm.v1.core.kv_cache_utils"
_REPR_FIELDS = ("block_id", "ref_cnt", "_block_hash", "_block_hash_num_tokens")
_REPR_FIELDS_034 = ("block_id", "ref_cnt", "block_hash", "block_hash_num_tokens")
_REPR_LINKS = ("prev_free_block", "next_free_block")
# A hash longer than any vLLM makes is not printed whole.
_HASH_BOUND = 1024


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


def empty() -> ValueError:
    return ValueError("No free blocks available")


def out_of_sync(num_free_blocks: int) -> AssertionError:
    return AssertionError(
        f"num_free_blocks ({number(num_free_blocks)}) is out of sync with the free list."
    )


def invalid_next(method: str) -> RuntimeError:
    return RuntimeError(
        f"Invalid block found in {method}() which doesn't have a valid next_free_block"
    )


# A lost end of the list. vLLM's append() raises TAIL_LOST as a RuntimeError, while its
# append_n() and prepend_n() assert (AssertionError): both twins keep vLLM's two types.
TAIL_LOST = "prev_free_block of fake_free_list_tail should always exist"
HEAD_LOST = "next_free_block of fake_free_list_head should always exist"


def too_many(n: int, num_free_blocks: int) -> AssertionError:
    return AssertionError(
        f"popleft_n({number(n)}) asked for more blocks than the {number(num_free_blocks)} free ones"
    )


def negative(n: int) -> ValueError:
    return ValueError(f"popleft_n() needs n >= 0, got {number(n)}")


def not_a_first_block(block_type: type, why: TypeError) -> TypeError:
    return TypeError(
        f"FreeKVCacheBlockQueue(): blocks[0] has type {_name(block_type)}, which the queue "
        f"cannot thread: {why}"
    )


def not_a_block(obj: object, block_type: type, where: str) -> TypeError:
    why = ""
    if is_subtype(type(obj), block_type):
        changed = layout_change(type(obj), block_type)
        why = (
            f", whose class redefines {changed} (the queue reads and writes "
            f"{_name(block_type)}'s own)"
        )
    return TypeError(f"{where}: expected a {_name(block_type)}, got {describe(obj)}{why}")


def corrupted(method: str, obj: object) -> RuntimeError:
    return RuntimeError(
        f"{method}(): the free list is corrupted (a link holds {describe(obj)}); were "
        "prev_free_block/next_free_block assigned outside the queue?"
    )


# What a batch's misuse raises under "raise".
_LINK_MISUSES = {
    "sentinel": "is a sentinel of this queue",
    "duplicate": "appears more than once in the batch",
    "linked": "is already linked into a free list",
}


def misuse(method: str, kind: QueueMisuse, block: object) -> Exception:
    """What a misuse of ``kind`` raises under ``"raise"``. The one vLLM raises too,
    ``remove()`` of a block that is not linked, names a block of vLLM's class or
    kvqueue's as vLLM does."""
    described = (vllm_repr(block) if kind == "not_linked" else None) or describe(block)
    if kind == "not_linked":
        return RuntimeError(f"remove() called on an invalid block: {described}")
    if kind == "other_pool":
        return ValueError(f"{method}() called on a block of another pool's queue: {described}")
    return ValueError(f"{method}() called on a block that {_LINK_MISUSES[kind]}: {described}")


def too_long(num_free_blocks: int) -> RuntimeError:
    return RuntimeError(
        f"the free list holds more than num_free_blocks ({number(num_free_blocks)}) blocks: "
        "it is corrupted (a cycle or a block of another queue)"
    )


def not_iterable(method: str) -> TypeError:
    return TypeError(f"{method}() needs an iterable of blocks")


def count_not_an_integer(value: object) -> TypeError:
    return TypeError(f"num_free_blocks must be an integer, not {_name(type(value))}")


def count_out_of_range(num: int) -> ValueError:
    return ValueError(f"num_free_blocks must be from 0 to sys.maxsize, not {number(num)}")


def len_overflow() -> OverflowError:
    return OverflowError("cannot fit 'int' into an index-sized integer")


COUNT_UNDELETABLE = "num_free_blocks cannot be deleted"

UNCOPYABLE = (
    "FreeKVCacheBlockQueue cannot be copied or pickled: it is threaded through its "
    "blocks' own links, which a copy would share; build a new queue from new blocks"
)

INITIALIZED = "the queue is already initialized"
BUILDING = "the queue is being initialized: __init__ cannot be called again from inside it"
UNINITIALIZED = "the queue is not initialized"


def describe(obj: object) -> str:
    """``obj`` for a message, bounded, and without calling anything of its own: a
    block's ``__repr__`` may walk the links (vLLM's dataclass does) or raise."""
    cls = type(obj)
    name = _name(cls)
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


def _name(cls: type) -> str:
    return str.__getitem__(_qualname(cls), _BOUND)
