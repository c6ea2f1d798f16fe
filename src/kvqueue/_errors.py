"""Exceptions shared by both twins, so that their types and messages match.

The messages of the errors vLLM raises are vLLM's, word for word: engines and
their tests match on them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from operator import index


def empty() -> ValueError:
    return ValueError("No free blocks available")


def out_of_sync(num_free_blocks: int) -> AssertionError:
    return AssertionError(f"num_free_blocks ({num_free_blocks}) is out of sync with the free list.")


def invalid_next(method: str) -> RuntimeError:
    return RuntimeError(
        f"Invalid block found in {method}() which doesn't have a valid next_free_block"
    )


def invalid_remove(block: object) -> RuntimeError:
    return RuntimeError(f"remove() called on an invalid block: {block}")


TAIL_LOST = "prev_free_block of fake_free_list_tail should always exist"
HEAD_LOST = "next_free_block of fake_free_list_head should always exist"


def too_many(n: int, num_free_blocks: int) -> AssertionError:
    return AssertionError(
        f"popleft_n({n}) asked for more blocks than the {num_free_blocks} free ones"
    )


def negative(n: int) -> ValueError:
    return ValueError(f"popleft_n() needs n >= 0, got {n}")


def not_a_first_block(obj: object, why: TypeError) -> TypeError:
    return TypeError(
        f"FreeKVCacheBlockQueue(): blocks[0] has type {type(obj).__qualname__}, which the "
        f"queue cannot thread: {why}"
    )


def not_a_block(obj: object, block_type: type, where: str) -> TypeError:
    return TypeError(
        f"{where}: expected a {block_type.__qualname__}, got {type(obj).__qualname__} {obj!r:.80}"
    )


def corrupted(where: str, obj: object) -> RuntimeError:
    return RuntimeError(
        f"{where}: the free list is corrupted (a link holds {type(obj).__qualname__} "
        f"{obj!r:.80}); were prev_free_block/next_free_block assigned outside the queue?"
    )


def already_linked(
    method: str,
    block: object,
    batch: Sequence[object],
    index: int,
    sentinels: tuple[object, object],
) -> ValueError:
    if block is sentinels[0] or block is sentinels[1]:
        why = "is a sentinel of this queue"
    elif any(block is other for other in batch[:index]):
        why = "appears more than once in the batch"
    else:
        why = "is already linked into a free list"
    return ValueError(f"{method}() called on a block that {why}: {block}")


def too_long(num_free_blocks: int) -> RuntimeError:
    return RuntimeError(
        f"the free list holds more than num_free_blocks ({num_free_blocks}) blocks: "
        "it is corrupted (a cycle or a block of another queue)"
    )


def not_iterable(method: str) -> str:
    return f"{method}() needs an iterable of blocks"


def other_pool(block: object) -> ValueError:
    return ValueError(f"remove() called on a block of another pool's queue: {block}")


def count(value: object) -> int:
    """``value`` as a new ``num_free_blocks``: an integer from 0 to ``sys.maxsize``."""
    try:
        num = index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"num_free_blocks must be an integer, not {type(value).__qualname__}"
        ) from None
    if not 0 <= num <= sys.maxsize:
        raise ValueError(f"num_free_blocks must be from 0 to sys.maxsize, not {num}")
    return num


COUNT_UNDELETABLE = "num_free_blocks cannot be deleted"

UNCOPYABLE = (
    "FreeKVCacheBlockQueue cannot be copied or pickled: it is threaded through its "
    "blocks' own links, which a copy would share; build a new queue from new blocks"
)

INITIALIZED = "the queue is already initialized"
