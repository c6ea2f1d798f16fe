"""The pure-Python free-block queue: the reference twin and the source of types.

The queue is an intrusive doubly linked list threaded through the blocks' own
``prev_free_block`` / ``next_free_block`` slots between two sentinel blocks, so
that a block can leave the middle of the queue in O(1). Hot methods read every
attribute once into a local: each attribute access costs more than the local.

Unlike vLLM's queue, every call validates its arguments before it mutates
anything (or rolls back the links it made), so misuse raises instead of
silently corrupting the list. Links assigned from outside the queue are not
checked here: the compiled twin checks them because it must never crash.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from operator import index
from typing import Any, Generic, Protocol, TypeVar, cast, final

from . import _errors
from ._block import KVCacheBlock, check_block_type, is_subtype

__all__ = ("FreeKVCacheBlockQueue",)


class LinkedBlock(Protocol):
    """What the queue needs of a block class (vLLM's and kvqueue's both fit)."""

    block_id: int
    prev_free_block: Any
    next_free_block: Any


B = TypeVar("B", bound=LinkedBlock)


@final
class FreeKVCacheBlockQueue(Generic[B]):
    """vLLM's ``FreeKVCacheBlockQueue``: free blocks in eviction order.

    The block class is that of ``blocks[0]``, or ``block_type`` (default
    :class:`kvqueue.KVCacheBlock`); the sentinels are ``block_type(block_id=-1)``.
    """

    __slots__ = ("__weakref__", "_block_type", "_head", "_num_free_blocks", "_tail")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # The compiled twin is a final type; keep the twins interchangeable.
        raise TypeError("FreeKVCacheBlockQueue is not an acceptable base type")

    def __init__(self, blocks: Iterable[B], *, block_type: type[B] | None = None) -> None:
        blocks = _as_sequence(blocks, "FreeKVCacheBlockQueue")
        if block_type is None:
            block_type = type(blocks[0]) if blocks else cast("type[B]", KVCacheBlock)
        check_block_type(block_type)
        make = cast(Any, block_type)
        head: Any = make(block_id=-1)
        tail: Any = make(block_id=-1)
        head.prev_free_block = None
        head.next_free_block = tail
        tail.prev_free_block = head
        tail.next_free_block = None
        self._head: B = head
        self._tail: B = tail
        self._block_type: type[B] = block_type
        self._num_free_blocks = 0
        if blocks:
            self._link("FreeKVCacheBlockQueue", head, tail, blocks)

    @property
    def num_free_blocks(self) -> int:
        return self._num_free_blocks

    @property
    def fake_free_list_head(self) -> B:
        return self._head

    @property
    def fake_free_list_tail(self) -> B:
        return self._tail

    @property
    def block_type(self) -> type[B]:
        return self._block_type

    def popleft(self) -> B:
        """Pop the first free block."""
        head: Any = self._head
        first: B = head.next_free_block
        if first is self._tail or first is None:
            if self._num_free_blocks != 0:
                raise _errors.out_of_sync(self._num_free_blocks)
            raise _errors.empty()
        next_block = first.next_free_block
        if next_block is None:
            raise _errors.invalid_next("popleft")
        head.next_free_block = next_block
        next_block.prev_free_block = head
        first.prev_free_block = first.next_free_block = None
        self._num_free_blocks -= 1
        return first

    def popleft_n(self, n: int, /) -> list[B]:
        """Pop the first ``n`` free blocks, in order."""
        if type(n) is not int:
            n = index(n)
        num = self._num_free_blocks
        if n <= 0:
            if n == 0:
                return []
            raise _errors.negative(n)
        if n > num:
            raise _errors.too_many(n, num)
        head: Any = self._head
        tail = self._tail
        curr = head.next_free_block
        if n == 1:
            # The decode step's case, inlined: no list walk, no second loop.
            if curr is None or curr is tail:
                raise _errors.out_of_sync(num)
            next_block = curr.next_free_block
            if next_block is None:
                raise _errors.invalid_next("popleft_n")
            head.next_free_block = next_block
            next_block.prev_free_block = head
            curr.prev_free_block = curr.next_free_block = None
            self._num_free_blocks = num - 1
            return [curr]
        # One pass, as vLLM's; a short or broken list is put back as it was.
        ret: list[B] = []
        for _ in range(n):
            if curr is None or curr is tail:
                _relink(head, ret, curr)
                raise _errors.out_of_sync(num)
            ret.append(curr)
            next_block = curr.next_free_block
            curr.prev_free_block = curr.next_free_block = None
            curr = next_block
        if curr is None:
            _relink(head, ret, curr)
            raise _errors.invalid_next("popleft_n")
        head.next_free_block = curr
        curr.prev_free_block = head
        self._num_free_blocks = num - n
        return ret

    def remove(self, block: B, /) -> None:
        """Take ``block`` out of the middle of the queue."""
        block_type = self._block_type
        if type(block) is not block_type and not is_subtype(type(block), block_type):
            raise _errors.not_a_block(block, block_type, "remove()")
        prev_block = block.prev_free_block
        next_block = block.next_free_block
        if prev_block is None or next_block is None:
            raise _errors.invalid_remove(block)
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self._num_free_blocks -= 1

    def append(self, block: B, /) -> None:
        """Put ``block`` at the end of the queue (evicted last)."""
        tail: Any = self._tail
        last_block = tail.prev_free_block
        if last_block is None:
            raise RuntimeError(_errors.TAIL_LOST)
        block_type = self._block_type
        if type(block) is not block_type and not is_subtype(type(block), block_type):
            raise _errors.not_a_block(block, block_type, "append()")
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise _errors.already_linked("append", block, (), 0, (self._head, tail))
        last_block.next_free_block = block
        block.prev_free_block = last_block
        block.next_free_block = tail
        tail.prev_free_block = block
        self._num_free_blocks += 1

    def append_n(self, blocks: Iterable[B], /) -> None:
        """Put ``blocks`` at the end of the queue, in order."""
        # The common list skips the call, which costs as much as linking a block.
        if type(blocks) is not list and type(blocks) is not tuple:
            blocks = _as_sequence(blocks, "append_n")
        if not blocks:
            return
        tail: Any = self._tail
        last_block = tail.prev_free_block
        if last_block is None:
            raise AssertionError(_errors.TAIL_LOST)
        if len(blocks) == 1:
            # One block, the most frequent batch: linked inline as append() does. Only
            # an exact-type, unlinked block takes this path; _link raises for the rest.
            block = blocks[0]
            if (
                type(block) is self._block_type
                and block.prev_free_block is None
                and block.next_free_block is None
            ):
                last_block.next_free_block = block
                block.prev_free_block = last_block
                block.next_free_block = tail
                tail.prev_free_block = block
                self._num_free_blocks += 1
                return
        self._link("append_n", last_block, tail, blocks)

    def prepend_n(self, blocks: Iterable[B], /) -> None:
        """Put ``blocks`` at the front of the queue (evicted first), in order."""
        if type(blocks) is not list and type(blocks) is not tuple:
            blocks = _as_sequence(blocks, "prepend_n")
        if not blocks:
            return
        head: Any = self._head
        first_block = head.next_free_block
        if first_block is None:
            raise AssertionError(_errors.HEAD_LOST)
        self._link("prepend_n", head, first_block, blocks)

    def _link(self, method: str, left: Any, right: Any, blocks: tuple[B, ...] | list[B]) -> None:
        """Link the non-empty ``blocks`` between ``left`` and ``right``.

        Each block is checked as it is linked; on the first bad one the links
        made so far are undone. A block seen twice is caught because its first
        visit already gave it a ``prev_free_block``. The checks cost about half
        of vLLM's loop again: they are what keeps a bad batch from corrupting
        the list.
        """
        block_type = self._block_type
        prev: Any = left
        try:
            for block in blocks:
                if type(block) is not block_type and not is_subtype(type(block), block_type):
                    break
                if block.prev_free_block is not None or block.next_free_block is not None:
                    break
                block.prev_free_block = prev
                prev.next_free_block = block
                prev = block
            else:
                prev.next_free_block = right
                right.prev_free_block = prev
                self._num_free_blocks += len(blocks)
                return
        except BaseException:
            _unlink_run(blocks[0], prev, left, right)
            raise
        position = _unlink_run(blocks[0], prev, left, right)
        if type(block) is not block_type and not is_subtype(type(block), block_type):
            raise _errors.not_a_block(block, block_type, f"{method}()")
        raise _errors.already_linked(method, block, blocks, position, (self._head, self._tail))

    def get_all_free_blocks(self) -> list[B]:
        """All free blocks in eviction order (a snapshot)."""
        curr: Any = self._head.next_free_block
        if curr is None:
            raise RuntimeError(_errors.HEAD_LOST)
        limit = self._num_free_blocks
        ret: list[B] = []
        while (next_block := curr.next_free_block) is not None:
            if len(ret) >= limit:
                raise _errors.too_long(limit)
            ret.append(curr)
            curr = next_block
        return ret

    def iter_blocks_after(self, cursor: B | None, /) -> Iterator[B]:
        """Iterate the free blocks after ``cursor`` (None: from the front).

        Lazy like vLLM's generator: each successor is read when it is asked
        for, so the iterator follows the live list across mutations.
        """
        if cursor is None:
            return self._iter_after(self._head)
        block_type = self._block_type
        if type(cursor) is not block_type and not is_subtype(type(cursor), block_type):
            raise _errors.not_a_block(cursor, block_type, "iter_blocks_after()")
        return self._iter_after(cursor)

    def _iter_after(self, curr: Any) -> Iterator[B]:
        tail = self._tail
        while True:
            curr = curr.next_free_block
            if curr is None or curr is tail:
                return
            yield curr

    def __iter__(self) -> Iterator[B]:
        return self._iter_after(self._head)

    def __len__(self) -> int:
        return self._num_free_blocks

    def __repr__(self) -> str:
        return (
            f"<{type(self).__qualname__} num_free_blocks={self._num_free_blocks} "
            f"block_type={self._block_type.__qualname__}>"
        )


def _as_sequence(blocks: Iterable[B], method: str) -> tuple[B, ...] | list[B]:
    """``blocks`` as a list or tuple, as C's ``PySequence_Fast`` gives it.

    Any other iterable is materialized before the first link is touched, so
    that its side effects cannot run in the middle of an update.
    """
    if type(blocks) is list or type(blocks) is tuple:
        return blocks
    try:
        iterator = iter(blocks)
    except TypeError:
        raise TypeError(_errors.not_iterable(method)) from None
    return list(iterator)


def _unlink_run(first: Any, last: Any, left: Any, right: Any) -> int:
    """Undo a partial ``_link`` of the run ``first`` .. ``last``; its length."""
    left.next_free_block = right
    if last is left:
        return 0
    count = 1
    block = first
    while block is not last:
        next_block = block.next_free_block
        block.prev_free_block = block.next_free_block = None
        block = next_block
        count += 1
    last.prev_free_block = last.next_free_block = None
    return count


def _relink(head: Any, popped: list[Any], rest: Any) -> None:
    """Undo a partial ``popleft_n``: ``popped`` were linked from ``head`` to ``rest``."""
    prev = head
    for block in popped:
        block.prev_free_block = prev
        prev.next_free_block = block
        prev = block
    prev.next_free_block = rest
