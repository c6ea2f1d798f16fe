"""The exceptions both twins raise, so that their types and messages match.

The messages of the errors vLLM raises are vLLM's, word for word: engines and
their tests match on them. A block or other argument appears in a message only
as ``_core.describe`` gives it, never through its own ``repr``.
"""

from __future__ import annotations


def number(n: int) -> str:
    """An int for a message: no subclass ``__format__``, no 4,300-digit limit to hit."""
    if -(10**30) < n < 10**30:
        return int.__repr__(n)
    return f"an integer of {int.bit_length(n)} bits"


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


TAIL_LOST = "prev_free_block of fake_free_list_tail should always exist"
HEAD_LOST = "next_free_block of fake_free_list_head should always exist"


def too_many(n: int, num_free_blocks: int) -> AssertionError:
    return AssertionError(
        f"popleft_n({number(n)}) asked for more blocks than the {number(num_free_blocks)} free ones"
    )


def negative(n: int) -> ValueError:
    return ValueError(f"popleft_n() needs n >= 0, got {number(n)}")


def not_a_first_block(type_name: str, why: TypeError) -> TypeError:
    return TypeError(
        f"FreeKVCacheBlockQueue(): blocks[0] has type {type_name}, which the queue cannot "
        f"thread: {why}"
    )


def not_a_block(described: str, block_type: str, where: str, why: str) -> TypeError:
    return TypeError(f"{where}: expected a {block_type}, got {described}{why}")


def corrupted(where: str, described: str) -> RuntimeError:
    return RuntimeError(
        f"{where}: the free list is corrupted (a link holds {described}); were "
        "prev_free_block/next_free_block assigned outside the queue?"
    )


# What each kind of misuse raises under "raise" (the kinds of _policy.KINDS).
_LINK_MISUSES = {
    "sentinel": "is a sentinel of this queue",
    "duplicate": "appears more than once in the batch",
    "linked": "is already linked into a free list",
}


def misuse(method: str, kind: str, described: str) -> Exception:
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


def count_not_an_integer(type_name: str) -> TypeError:
    return TypeError(f"num_free_blocks must be an integer, not {type_name}")


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
