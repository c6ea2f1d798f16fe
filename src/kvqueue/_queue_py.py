"""The pure-Python free-block queue: the reference twin and the source of types.

The queue is an intrusive doubly linked list threaded through the blocks' own
``prev_free_block`` / ``next_free_block`` slots between two sentinel blocks, so
that a block can leave the middle of the queue in O(1). Hot methods read every
attribute once into a local: each attribute access costs more than the local.

Unlike vLLM's queue, every call validates its arguments before it mutates
anything (or rolls back the links it made), so misuse raises instead of
silently corrupting the list, or, under ``on_misuse="repair"``, is repaired
and reported (see ``_policy``). Links assigned from outside the queue are not
checked here: the compiled twin checks them because it must never crash.

The list's invariants, kept by every call, whether it returns or raises, even
for an exception raised asynchronously between two of its bytecodes (a
``KeyboardInterrupt``, or the ``SystemExit`` of vLLM's signal handlers): each
method writes the list only inside a ``try`` whose handler puts back every link
and the count it read, all absolute writes that need no progress marker. And, as
in the compiled twin,
no Python code runs between a method's first read of the list and its last
write: the allocations that may start a collection, whose finalizers may call
the queue, and the checks of a subclass's blocks, come before the reads.

* ``head.prev_free_block`` and ``tail.next_free_block`` are None; following
  ``next_free_block`` from ``head`` reaches ``tail``, and ``prev_free_block``
  retraces the same path backwards.
* A block is in the list exactly when either of its links is not None; a
  block taken out has both links set to None.
* ``num_free_blocks - _offset`` is the number of blocks between the
  sentinels. ``_offset`` is 0 unless a caller assigned ``num_free_blocks``
  (as vLLM's tests do to fake a full cache); every call then moves the
  assigned count as it moves the true one.
* A queue bound to a pool (its blocks all carried that ``pool`` when it was
  built) only ever links or unlinks blocks of that pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import index, length_hint
from typing import Any, Generic, NoReturn, Protocol, TypeVar, cast, final

from . import _core, _errors, _log, _policy
from ._block import KVCacheBlock, check_block_type, is_block

__all__ = ("FreeKVCacheBlockQueue",)


class LinkedBlock(Protocol):
    """What the queue needs of a block class (vLLM's and kvqueue's both fit)."""

    block_id: int
    prev_free_block: Any
    next_free_block: Any


B = TypeVar("B", bound=LinkedBlock)
#: What admits a batch to a queue's list: ``gate(method, blocks)`` -> the blocks to link.
Gate = Callable[[str, Sequence[Any]], Sequence[Any]]


@final
class FreeKVCacheBlockQueue(Generic[B]):
    """vLLM's ``FreeKVCacheBlockQueue``: free blocks in eviction order.

    The block class is that of ``blocks[0]``, or ``block_type`` (default
    :class:`kvqueue.KVCacheBlock`); the sentinels are ``block_type(block_id=-1)``.
    ``on_misuse`` is ``"raise"`` or ``"repair"``; None reads the environment
    variable ``KVQUEUE_ON_MISUSE`` (unset: ``"raise"``). Building is O(n).

    Raises TypeError for a non-iterable ``blocks`` or a non-block in it,
    ValueError for a block given twice or already linked (under ``"raise"``)
    and for an unknown policy.
    """

    __slots__ = (
        "__weakref__",
        "_block_type",
        "_building",
        "_gate",
        "_head",
        "_num_free_blocks",
        "_offset",
        "_on_misuse",
        "_pool",
        "_repairs",
        "_tail",
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # The compiled twin is a final type; keep the twins interchangeable.
        raise TypeError("FreeKVCacheBlockQueue is not an acceptable base type")

    def __init__(
        self,
        blocks: Iterable[B],
        *,
        block_type: type[B] | None = None,
        on_misuse: _policy.MisusePolicy | None = None,
    ) -> None:
        if hasattr(self, "_head"):
            raise RuntimeError(_errors.INITIALIZED)
        # The block class's constructor runs below: it may reach this queue (through
        # gc.get_objects()) and call __init__ again, which must not rebuild it.
        if getattr(self, "_building", False):
            raise RuntimeError(_errors.BUILDING)
        self._building = True
        try:
            self._build(blocks, block_type, on_misuse)
        finally:
            self._building = False

    def _build(self, blocks: Iterable[B], block_type: type[B] | None, on_misuse: object) -> None:
        blocks = _core.as_sequence(blocks, "FreeKVCacheBlockQueue")
        if block_type is None:
            block_type = _core.first_block_type(blocks) if blocks else cast("type[B]", KVCacheBlock)
        else:
            check_block_type(block_type)
        policy = _policy.resolve(on_misuse)
        make = cast(Any, block_type)
        head: Any = make(block_id=-1)
        tail: Any = make(block_id=-1)
        if not (is_block(head, block_type) and is_block(tail, block_type)):
            raise TypeError(f"{block_type.__qualname__}(block_id=-1) did not make a block")
        head.prev_free_block = None
        head.next_free_block = tail
        tail.prev_free_block = head
        tail.next_free_block = None
        pool = _core.common_pool(block_type, blocks)
        self._block_type: type[B] = block_type
        self._num_free_blocks = 0
        self._offset = 0
        self._on_misuse = policy
        self._gate: Gate | None = None
        self._pool = pool
        self._repairs: dict[str, int] = dict.fromkeys(_policy.QUEUE_MISUSES, 0)
        self._tail: B = tail
        # Last: a queue with a head is built (a call on it from the constructor
        # above found no head and failed).
        self._head: B = head
        if blocks:
            self._link("FreeKVCacheBlockQueue", False, blocks)

    @property
    def num_free_blocks(self) -> int:
        """The number of free blocks. Assignable, as vLLM's plain attribute is (its
        tests set 0 to fake a full cache): later calls then move the assigned count,
        while the queue's own checks keep using the true length. Raises TypeError
        for a non-integer, ValueError for one below 0 or above sys.maxsize.
        """
        return self._num_free_blocks

    @num_free_blocks.setter
    def num_free_blocks(self, value: int) -> None:
        count = _core.count(value)  # Python code (__index__): before the state is read
        num, offset = self._num_free_blocks, self._offset
        try:
            self._offset = offset + count - num
            self._num_free_blocks = count
        except BaseException:
            self._num_free_blocks, self._offset = num, offset
            raise

    @num_free_blocks.deleter
    def num_free_blocks(self) -> None:
        raise AttributeError(_errors.COUNT_UNDELETABLE)

    @property
    def fake_free_list_head(self) -> B:
        """The head sentinel, before the first free block."""
        return self._head

    @property
    def fake_free_list_tail(self) -> B:
        """The tail sentinel, after the last free block."""
        return self._tail

    @property
    def block_type(self) -> type[B]:
        """The class of the blocks this queue threads."""
        return self._block_type

    @property
    def on_misuse(self) -> _policy.MisusePolicy:
        """``"raise"`` or ``"repair"``: what this queue does on misuse."""
        return self._on_misuse

    @property
    def repairs(self) -> dict[str, int]:
        """How many misuses of each kind this queue repaired (a new dict)."""
        return dict(self._repairs)

    @property
    def gate(self) -> Gate | None:
        """What admits blocks to the list (None: every block the queue's checks pass).

        Called as ``gate(method, blocks)`` by ``append``, ``append_n`` and ``prepend_n``
        with the batch (a list or tuple; ``[block]`` for ``append``) before the queue reads
        its list; the batch methods link the sequence it returns, ``append`` links its block
        only if that sequence is not empty. What the gate raises leaves the queue as it was.
        Settable to None or a callable; raises TypeError for anything else.
        """
        return self._gate

    @gate.setter
    def gate(self, value: Gate | None) -> None:
        self._gate = _core.gate(value)

    def popleft(self, /) -> B:
        """Pop the first free block. O(1).

        Raises ValueError when the queue is empty.
        """
        head: Any = self._head
        first: B = head.next_free_block
        if first is not None:
            # The tail's next_free_block is None: one test finds the end and a broken link.
            next_block = first.next_free_block
            if next_block is not None:
                num = self._num_free_blocks
                try:
                    head.next_free_block = next_block
                    next_block.prev_free_block = head
                    first.prev_free_block = first.next_free_block = None
                    self._num_free_blocks = num - 1
                    return first
                except BaseException:
                    self._undo(head, (first,), next_block)
                    self._num_free_blocks = num
                    raise
            if first is not self._tail:
                raise _errors.invalid_next("popleft")
        # vLLM asserts that the count is 0 here before it raises ValueError.
        num = self._num_free_blocks
        if num != 0:
            raise _errors.out_of_sync(num)
        raise _errors.empty()

    def popleft_n(self, n: int, /) -> list[B]:
        """Pop the first ``n`` free blocks, in order. O(n).

        Raises TypeError for a non-integer ``n``, ValueError for a negative
        one, AssertionError when ``n`` exceeds ``num_free_blocks``.
        """
        if type(n) is not int:
            n = index(n)  # Python code (__index__): before the state is read
        head: Any = self._head
        if n == 1:
            # The decode step's case, inlined: no list walk, no second loop.
            num = self._num_free_blocks
            if num < 1:
                raise _errors.too_many(1, num)
            curr = head.next_free_block
            if curr is None:
                raise _errors.out_of_sync(num)
            next_block = curr.next_free_block
            if next_block is None:
                raise _walk_error(curr is self._tail, num)
            try:
                head.next_free_block = next_block
                next_block.prev_free_block = head
                curr.prev_free_block = curr.next_free_block = None
                self._num_free_blocks = num - 1
                return [curr]
            except BaseException:
                self._undo(head, (curr,), next_block)
                self._num_free_blocks = num
                raise
        if n <= 0:
            if n == 0:
                return []
            raise _errors.negative(n)
        # Allocated before the reads; 3.12+ runs the collection at the next call.
        ret: list[B] = []
        steps = range(n)
        num = self._num_free_blocks
        if n > num:
            raise _errors.too_many(n, num)
        tail = self._tail
        curr = head.next_free_block
        if curr is None:
            raise _errors.out_of_sync(num)
        # One pass, as vLLM's. At every bytecode the first block not yet taken is
        # `next_block` once `curr` is in `ret`, else `curr`: the handler relinks
        # the taken blocks before it.
        try:
            for _ in steps:
                # None after the tail or a broken link: one test per block finds both.
                next_block = curr.next_free_block
                if next_block is None:
                    raise _walk_error(curr is tail or len(ret) + 1 < n, num)
                ret.append(curr)
                curr.prev_free_block = curr.next_free_block = None
                curr = next_block
            head.next_free_block = curr
            curr.prev_free_block = head
            self._num_free_blocks = num - n
            return ret
        except BaseException:
            self._undo(head, ret, next_block if ret and ret[-1] is curr else curr)
            self._num_free_blocks = num
            raise

    def remove(self, block: B, /) -> None:
        """Take ``block`` out of the middle of the queue. O(1).

        Raises TypeError for a non-block, RuntimeError for a block that is
        not linked, ValueError for a block of another pool; under
        ``"repair"`` the last two are no-ops.
        """
        if type(block) is not self._block_type and not is_block(block, self._block_type):
            raise _errors.not_a_block(block, self._block_type, "remove()")
        if self._pool is not None and block.pool is not self._pool:  # type: ignore[attr-defined]
            return self._misused_remove(block)
        prev_block = block.prev_free_block
        next_block = block.next_free_block
        if prev_block is None or next_block is None:
            return self._misused_remove(block)
        num = self._num_free_blocks
        try:
            prev_block.next_free_block = next_block
            next_block.prev_free_block = prev_block
            block.prev_free_block = block.next_free_block = None
            self._num_free_blocks = num - 1
        except BaseException:
            self._undo(prev_block, (block,), next_block)
            self._num_free_blocks = num
            raise

    def _misused_remove(self, block: B) -> None:
        """Which misuse a refused ``remove(block)`` was, raised or repaired. Out of the
        O(1) call's body, as ``_misused_append``, as in the compiled twin."""
        # A sentinel's pool is None, but removing one is the unbound queue's error.
        if (
            self._pool is not None
            and block.pool is not self._pool  # type: ignore[attr-defined]
            and block is not self._head
            and block is not self._tail
        ):
            return self._misuse("remove", block, "other_pool")
        return self._misuse("remove", block, "not_linked")

    def append(self, block: B, /) -> None:
        """Put ``block`` at the end of the queue (evicted last). O(1).

        Raises TypeError for a non-block, ValueError for a linked block or a
        sentinel (under ``"repair"``: skipped), and what the :attr:`gate` raises.
        """
        gate = self._gate
        if gate is not None and not gate("append", [block]):
            return
        tail: Any = self._tail
        last_block = tail.prev_free_block
        if last_block is None:
            raise RuntimeError(_errors.TAIL_LOST)
        if type(block) is not self._block_type and not is_block(block, self._block_type):
            raise _errors.not_a_block(block, self._block_type, "append()")
        if (
            block.prev_free_block is not None
            or block.next_free_block is not None
            or (self._pool is not None and block.pool is not self._pool)  # type: ignore[attr-defined]
        ):
            return self._misused_append(block)
        num = self._num_free_blocks
        # The one-block link, written out here and in append_n: a call to a
        # helper costs as much as the link itself.
        try:
            last_block.next_free_block = block
            block.prev_free_block = last_block
            block.next_free_block = tail
            tail.prev_free_block = block
            self._num_free_blocks = num + 1
        except BaseException:
            self._undo(last_block, (), tail, (block,))
            self._num_free_blocks = num
            raise

    def _misused_append(self, block: B) -> None:
        """Which misuse a refused ``append(block)`` was, raised or repaired."""
        if block.prev_free_block is None and block.next_free_block is None:
            return self._misuse("append", block, "other_pool")
        if block is self._head or block is self._tail:
            return self._misuse("append", block, "sentinel")
        return self._misuse("append", block, "linked")

    def append_n(self, blocks: Iterable[B], /) -> None:
        """Put ``blocks`` at the end of the queue, in order. O(len(blocks)).

        Raises as :meth:`append`, before anything is linked.
        """
        # The common list skips the call, which costs as much as linking a block.
        if type(blocks) is not list and type(blocks) is not tuple:
            blocks = _core.as_sequence(blocks, "append_n")
        if not blocks:
            return
        if self._gate is not None:
            blocks = _core.as_sequence(self._gate("append_n", blocks), "append_n")
            if not blocks:
                return
        if len(blocks) == 1:
            # One block, the most frequent batch, linked as append() links it. Only an
            # exact-type, unlinked block of the pool takes this path; _link reports the rest.
            block = blocks[0]
            if (
                type(block) is self._block_type
                and block.prev_free_block is None
                and block.next_free_block is None
                and (self._pool is None or block.pool is self._pool)  # type: ignore[attr-defined]
            ):
                tail: Any = self._tail
                last_block = tail.prev_free_block
                if last_block is None:
                    raise AssertionError(_errors.TAIL_LOST)
                num = self._num_free_blocks
                try:
                    last_block.next_free_block = block
                    block.prev_free_block = last_block
                    block.next_free_block = tail
                    tail.prev_free_block = block
                    self._num_free_blocks = num + 1
                except BaseException:
                    self._undo(last_block, (), tail, (block,))
                    self._num_free_blocks = num
                    raise
                return
        else:
            # vLLM's free path: _link's loop for exact-type blocks, written out here
            # because the call costs as much as linking a block. Any other block
            # stops it, with nothing linked, and _link takes the batch.
            block_type = self._block_type
            pool = self._pool
            it = iter(blocks)  # before the ends are read, as in _link
            right: Any = self._tail
            left = right.prev_free_block
            if left is None:
                raise AssertionError(_errors.TAIL_LOST)
            num = self._num_free_blocks
            prev: Any = left
            try:
                for block in it:
                    if type(block) is not block_type:
                        break
                    if block.prev_free_block is not None or block.next_free_block is not None:
                        break
                    # A bound queue's class has `pool` as a plain slot: reading it runs
                    # no Python code (an unset one raises AttributeError, undone below).
                    if pool is not None and block.pool is not pool:  # type: ignore[attr-defined]
                        break
                    block.prev_free_block = prev
                    prev.next_free_block = block
                    prev = block
                else:
                    prev.next_free_block = right
                    right.prev_free_block = prev
                    self._num_free_blocks = num + len(blocks)
                    return
                self._undo(left, (), right, blocks)
            except BaseException:
                self._undo(left, (), right, blocks)
                self._num_free_blocks = num
                raise
        self._link("append_n", False, blocks)

    def prepend_n(self, blocks: Iterable[B], /) -> None:
        """Put ``blocks`` at the front of the queue (evicted first), in order.
        O(len(blocks)).

        Raises as :meth:`append`, before anything is linked.
        """
        if type(blocks) is not list and type(blocks) is not tuple:
            blocks = _core.as_sequence(blocks, "prepend_n")
        if not blocks:
            return
        if self._gate is not None:
            blocks = _core.as_sequence(self._gate("prepend_n", blocks), "prepend_n")
            if not blocks:
                return
        self._link("prepend_n", True, blocks)

    def _link(self, method: str, front: bool, blocks: Sequence[B], screened: bool = False) -> bool:
        """Link the non-empty ``blocks`` at the front or the end; whether it did.

        Each block is checked as it is linked; on the first bad one the links
        made so far are undone. A block seen twice is caught because its first
        visit already gave it a ``prev_free_block``. The checks cost about half
        of vLLM's loop again: they are what keeps a bad batch from corrupting
        the list. Under ``"repair"`` a bad batch is screened and its good
        blocks linked; ``screened`` marks that second pass, which returns
        False, with nothing linked, if one of them was linked meanwhile.
        ``append_n`` writes this loop out again for its exact-type blocks: an
        edit to one is an edit to both.
        """
        block_type = self._block_type
        # Whether the batch's classes and pools were checked in a pass of their own (a
        # bound queue's, or a batch with a subclass's block, whose check runs Python
        # code): that leaves the loop as it is for an unbound queue's exact-type blocks
        # (the constructor's 100,000 and more).
        checked = False
        while True:
            if checked or self._pool is not None:
                # A lost end is reported before the blocks, as by the compiled twin.
                if front and self._head.next_free_block is None:
                    raise AssertionError(_errors.HEAD_LOST)
                if not front and self._tail.prev_free_block is None:
                    raise AssertionError(_errors.TAIL_LOST)
                stop = self._checked_run(blocks)
                if stop < len(blocks):
                    return self._link_failed(method, front, blocks, stop, screened)
                checked = True
            it = iter(blocks)  # allocated by a call before the ends are read, as in popleft_n
            if front:
                left: Any = self._head
                right = left.next_free_block
                if right is None:
                    raise AssertionError(_errors.HEAD_LOST)
            else:
                right = self._tail
                left = right.prev_free_block
                if left is None:
                    raise AssertionError(_errors.TAIL_LOST)
            num = self._num_free_blocks
            prev: Any = left
            try:
                for block in it:
                    # A subclass's check runs Python code: not while the batch is half linked.
                    if type(block) is not block_type and not checked:
                        break
                    if block.prev_free_block is not None or block.next_free_block is not None:
                        break
                    block.prev_free_block = prev
                    prev.next_free_block = block
                    prev = block
                else:
                    prev.next_free_block = right
                    right.prev_free_block = prev
                    self._num_free_blocks = num + len(blocks)
                    return True
                self._undo(left, (), right, blocks)
            except BaseException:
                self._undo(left, (), right, blocks)
                self._num_free_blocks = num
                raise
            # The loop's index, from what its iterator has left: a counter would cost
            # every block.
            position = len(blocks) - length_hint(it) - 1
            if checked or type(block) is block_type:
                return self._link_failed(method, front, blocks, position, screened)
            checked = True

    def _checked_run(self, blocks: Sequence[B]) -> int:
        """``len(blocks)`` if every item is a block of the queue's class (and, for a
        bound queue, of its pool), else the index at which linking the batch fails:
        the first item that is not, or a block before it that is linked or given
        twice (the compiled twin's loop finds those)."""
        block_type = self._block_type
        pool = self._pool
        stop = 0
        for block in blocks:
            if type(block) is not block_type and not is_block(block, block_type):
                break
            if pool is not None and getattr(block, "pool", None) is not pool:
                break
            stop += 1
        if stop == len(blocks):
            return stop
        seen: set[int] = set()
        for i in range(stop):
            block = blocks[i]
            if block.prev_free_block is not None or block.next_free_block is not None:
                return i
            if id(block) in seen:
                return i
            seen.add(id(block))
        return stop

    def _link_failed(
        self, method: str, front: bool, blocks: Sequence[B], position: int, screened: bool
    ) -> bool:
        """``_link`` stopped at ``blocks[position]``, with nothing linked: raise, repair,
        or, on the screened pass, return False."""
        block = blocks[position]
        block_type = self._block_type
        if type(block) is not block_type and not is_block(block, block_type):
            raise _errors.not_a_block(block, block_type, f"{method}()")
        linked = block.prev_free_block is not None or block.next_free_block is not None
        if not linked and self._pool is not None:
            block.pool  # type: ignore[attr-defined]  # noqa: B018 (unset: AttributeError)
        kind = _core.link_misuse(block, blocks, position, linked, (self._head, self._tail))
        if screened:
            return False
        if self._on_misuse == "repair":
            self._link_repaired(method, front, blocks)
            return True
        raise _errors.misuse(method, kind, block)

    def _link_repaired(self, method: str, front: bool, blocks: Sequence[B]) -> None:
        """Link the good blocks of a batch that failed ``_link``, then report the rest.

        Raises TypeError, with nothing linked, if the batch holds a non-block.
        Screens again if a block it found free was linked before it could link
        it (a finalizer run between the two passes may free one).
        """
        while True:
            good, skipped = self._screen(method, blocks)
            if not good or self._link(method, front, good, screened=True):
                break
        for block, kind in skipped:
            self._misuse(method, block, kind)

    def _screen(
        self, method: str, blocks: Sequence[B]
    ) -> tuple[list[B], list[tuple[B, _policy.QueueMisuse]]]:
        """The blocks of a batch that can be linked, and the rest with their misuse."""
        block_type = self._block_type
        pool = self._pool
        sentinels = (self._head, self._tail)
        seen: set[int] = set()
        good: list[B] = []
        skipped: list[tuple[B, _policy.QueueMisuse]] = []
        for block in blocks:
            if type(block) is not block_type and not is_block(block, block_type):
                raise _errors.not_a_block(block, block_type, f"{method}()")
            if block is sentinels[0] or block is sentinels[1]:
                skipped.append((block, "sentinel"))
            elif id(block) in seen:
                skipped.append((block, "duplicate"))
            elif block.prev_free_block is not None or block.next_free_block is not None:
                skipped.append((block, "linked"))
            elif pool is not None and block.pool is not pool:  # type: ignore[attr-defined]
                skipped.append((block, "other_pool"))
            else:
                seen.add(id(block))
                good.append(block)
        return good, skipped

    def _misuse(self, method: str, block: B, kind: _policy.QueueMisuse) -> None:
        """Raise under ``"raise"``; else count and report the repair. The message
        is made only here, when it is needed."""
        if self._on_misuse != "repair":
            raise _errors.misuse(method, kind, block)
        count = self._repairs[kind] + 1
        self._repairs[kind] = count
        _log.queue_repaired(method, block, kind, count)

    def _undo(self, left: Any, run: Sequence[Any], right: Any, partial: Sequence[Any] = ()) -> None:
        """Put the list between ``left`` and ``right`` back as it was: ``run`` linked
        between them, the blocks of ``partial`` that this call linked (those from the
        first whose ``prev_free_block`` is the block before them) out.

        Every write is absolute, so that it is right however far the call got. The
        loops index instead of iterating: an iterator is an allocation, which can
        start a collection whose finalizers would see the list half restored.
        """
        prev = left
        i = 0
        while i < len(run):
            block = run[i]
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
            i += 1
        prev.next_free_block = right
        if right is not None:  # None: popleft_n found the list broken there
            right.prev_free_block = prev
        block_type = self._block_type
        prev = left
        i = 0
        while i < len(partial):
            block = partial[i]
            if block is right or (
                type(block) is not block_type and not is_block(block, block_type)
            ):
                break
            if block.prev_free_block is not prev:
                break
            prev = block
            i += 1
        # From the last: a block keeps its prev_free_block until its turn, so that
        # an undo cut short by an exception finds the rest when it is run again.
        while i > 0:
            i -= 1
            block = partial[i]
            block.next_free_block = None
            block.prev_free_block = None

    def get_all_free_blocks(self, /) -> list[B]:
        """All free blocks in eviction order (a snapshot). O(n).

        Raises RuntimeError if the list is corrupted (longer than its count).
        """
        # Allocated by a call: 3.12+ runs the collection there, before the reads.
        ret: list[B] = list()  # noqa: C408
        curr: Any = self._head.next_free_block
        if curr is None:
            raise RuntimeError(_errors.HEAD_LOST)
        limit = self._num_free_blocks - self._offset
        while (next_block := curr.next_free_block) is not None:
            if len(ret) >= limit:
                raise _errors.too_long(limit)
            ret.append(curr)
            curr = next_block
        return ret

    def iter_blocks_after(self, cursor: B | None, /) -> Iterator[B]:
        """Iterate the free blocks after ``cursor`` (None: from the front).

        Lazy like vLLM's generator: each successor is read when it is asked
        for, so the iterator follows the live list across mutations. O(1) per
        step. Raises TypeError for a cursor that is neither None nor a block.
        """
        if cursor is None:
            return self._iter_after(self._head)
        block_type = self._block_type
        if type(cursor) is not block_type and not is_block(cursor, block_type):
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

    def __reduce_ex__(self, protocol: object, /) -> NoReturn:
        """Refuse: copy, deepcopy and pickle raise TypeError (a copy would share the links)."""
        raise TypeError(_errors.UNCOPYABLE)

    def __repr__(self) -> str:
        if not hasattr(self, "_head"):
            return f"<{type(self).__qualname__} num_free_blocks=0 block_type=uninitialized>"
        return (
            f"<{type(self).__qualname__} num_free_blocks={self._num_free_blocks} "
            f"block_type={self._block_type.__qualname__}>"
        )


def _walk_error(past_the_end: bool, num: int) -> Exception:
    """What popleft_n raises at a block whose ``next_free_block`` is None: the
    count's error if it had to take more blocks (or that block is the tail),
    else the broken link's, as the compiled twin's walk does."""
    return _errors.out_of_sync(num) if past_the_end else _errors.invalid_next("popleft_n")
