"""How kvqueue says what went wrong: every exception and message both twins, the pool
guard, the holder audit and the vLLM checks raise.

The messages of the errors vLLM raises are vLLM's, word for word: engines and
their tests match on them. Objects appear in them as ``_render`` gives them, without
running their code; the misuses repaired under ``"repair"`` are named in ``_policy``.
"""

from __future__ import annotations

from ._block import is_subtype, layout_change
from ._policy import QueueMisuse
from ._render import describe, number, type_name, vllm_repr


class HolderAuditError(RuntimeError):
    """The holder audit found a block that a live request lists in the free list, or
    listed more times than it is held, before a scheduler step handed anything out."""


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
        f"FreeKVCacheBlockQueue(): blocks[0] has type {type_name(block_type)}, which the queue "
        f"cannot thread: {why}"
    )


def not_a_block(obj: object, block_type: type, where: str) -> TypeError:
    why = ""
    if is_subtype(type(obj), block_type):
        changed = layout_change(type(obj), block_type)
        why = (
            f", whose class redefines {changed} (the queue reads and writes "
            f"{type_name(block_type)}'s own)"
        )
    return TypeError(f"{where}: expected a {type_name(block_type)}, got {describe(obj)}{why}")


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
    return TypeError(f"num_free_blocks must be an integer, not {type_name(type(value))}")


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
