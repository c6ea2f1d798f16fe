"""The reference both twins are held to: every queue of a program as a plain list.

An ``Oracle`` stands where a twin's module stands (``oracle.FreeKVCacheBlockQueue``)
and its queues answer the twins' calls: the blocks they return, the exceptions a
misuse raises under ``"raise"``, and under ``"repair"`` the blocks skipped and the
kinds counted. Its cursors are as lazy as the twins': each step asks the live
lists for the block after the last one, so a cursor follows its block into
another queue (and ends on that queue's tail) or out of every queue (and ends).

It reads no link of a block and imports neither twin: it is what they are
compared to. Blocks are told apart by identity, as the twins tell them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from operator import index
from typing import Any

# What each misuse raises under "raise"; under "repair" its count (the twins' kinds).
MISUSES: dict[str, type[Exception]] = {
    "duplicate": ValueError,
    "linked": ValueError,
    "sentinel": ValueError,
    "not_linked": RuntimeError,
    "other_pool": ValueError,
}


class Oracle:
    """The queues of one program; the objects of ``block_type`` are its blocks."""

    def __init__(self, block_type: type) -> None:
        self.block_type = block_type
        self.owner: dict[int, OracleQueue] = {}  # id(block): the queue whose list holds it
        self._sentinels: dict[int, OracleQueue] = {}  # id(sentinel): its queue

    # The twins' name: an oracle stands where a twin's module stands.
    def FreeKVCacheBlockQueue(
        self,
        blocks: Iterable[Any],
        *,
        on_misuse: str = "raise",
        sentinels: tuple[Any, Any] | None = None,
    ) -> OracleQueue:
        """A queue of ``blocks``; ``sentinels``: the twin's own, to be told apart as its
        are (default: two new blocks of id -1, as a twin makes)."""
        return OracleQueue(self, list(blocks), on_misuse, sentinels)

    def is_block(self, obj: object) -> bool:
        return isinstance(obj, self.block_type)

    def linked(self, block: Any) -> bool:
        """Whether ``block`` has a link: it is in a queue's list, or a sentinel."""
        return id(block) in self.owner or id(block) in self._sentinels

    def successor(self, block: Any) -> Any:
        """The ``next_free_block`` a twin's ``block`` would have now (None: none)."""
        queue = self.owner.get(id(block))
        if queue is not None:
            at = queue.position(block) + 1
        else:
            queue = self._sentinels.get(id(block))
            if queue is None or block is not queue.fake_free_list_head:
                return None  # detached, or a tail
            at = 0
        return queue.blocks[at] if at < len(queue.blocks) else queue.fake_free_list_tail

    def adopt(self, queue: OracleQueue) -> None:
        """Know ``queue``'s sentinels from now on: a built queue's, whose build linked."""
        for sentinel in (queue.fake_free_list_head, queue.fake_free_list_tail):
            self._sentinels[id(sentinel)] = queue


class OracleQueue:
    """One queue: ``blocks``, its free blocks in order, and ``repairs``, by kind."""

    def __init__(
        self,
        oracle: Oracle,
        blocks: list[Any],
        on_misuse: str,
        sentinels: tuple[Any, Any] | None,
    ) -> None:
        if sentinels is None:
            sentinels = (oracle.block_type(block_id=-1), oracle.block_type(block_id=-1))
        self.fake_free_list_head, self.fake_free_list_tail = sentinels
        self.oracle = oracle
        self.on_misuse = on_misuse
        self.blocks: list[Any] = []
        self.repairs = dict.fromkeys(MISUSES, 0)
        pools = {id(getattr(b, "pool", None)): getattr(b, "pool", None) for b in blocks}
        # Bound to a pool when every block carries the same one.
        self.pool = next(iter(pools.values())) if len(pools) == 1 else None
        self._link("FreeKVCacheBlockQueue", blocks, front=False)
        oracle.adopt(self)

    @property
    def num_free_blocks(self) -> int:
        return len(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def position(self, block: Any) -> int:
        return next(i for i, b in enumerate(self.blocks) if b is block)

    def popleft(self) -> Any:
        if not self.blocks:
            raise ValueError("No free blocks available")
        return self._unlink(self.blocks[:1])[0]

    def popleft_n(self, n: Any) -> list[Any]:
        n = index(n)
        if n < 0:
            raise ValueError(f"popleft_n() needs n >= 0, got {n}")
        if n > len(self.blocks):
            raise AssertionError(f"popleft_n({n}) asked for more than {len(self.blocks)}")
        return self._unlink(self.blocks[:n])

    def remove(self, block: Any) -> None:
        self._check_block(block)
        sentinel = block is self.fake_free_list_head or block is self.fake_free_list_tail
        if self.pool is not None and block.pool is not self.pool:
            return self._misuse("remove", block, "not_linked" if sentinel else "other_pool")
        owner = self.oracle.owner.get(id(block))
        if owner is None:
            return self._misuse("remove", block, "not_linked")
        # A twin cannot tell: it would unlink the block and miscount both queues.
        assert owner is self, "remove() of another queue's block is not a modelled program"
        self._unlink([block])
        return None

    def append(self, block: Any) -> None:
        self._link("append", [block], front=False)

    def append_n(self, blocks: Iterable[Any]) -> None:
        self._link("append_n", list(blocks), front=False)

    def prepend_n(self, blocks: Iterable[Any]) -> None:
        self._link("prepend_n", list(blocks), front=True)

    def get_all_free_blocks(self) -> list[Any]:
        return list(self.blocks)

    def iter_blocks_after(self, cursor: Any) -> Iterator[Any]:
        if cursor is None:
            return self._iter_after(self.fake_free_list_head)
        self._check_block(cursor)
        return self._iter_after(cursor)

    def __iter__(self) -> Iterator[Any]:
        return self._iter_after(self.fake_free_list_head)

    def _iter_after(self, curr: Any) -> Iterator[Any]:
        while True:
            curr = self.oracle.successor(curr)
            if curr is None or curr is self.fake_free_list_tail:
                return
            yield curr

    def _link(self, method: str, batch: list[Any], front: bool) -> None:
        """Under "raise" the first bad item refuses the batch; under "repair" a
        non-block anywhere refuses it, and the other bad items are skipped and
        counted. Nothing changes before either refusal."""
        seen: set[int] = set()
        kinds: list[str | None] = []
        for block in batch:
            kind = self._misuse_of(block, seen)
            if kind is not None and self.on_misuse == "raise":
                self._misuse(method, block, kind)
            kinds.append(kind)
        good = [block for block, kind in zip(batch, kinds, strict=True) if kind is None]
        self.blocks[0 if front else len(self.blocks) : 0] = good
        for block in good:
            self.oracle.owner[id(block)] = self
        for block, kind in zip(batch, kinds, strict=True):
            if kind is not None:
                self._misuse(method, block, kind)

    def _misuse_of(self, block: Any, seen: set[int]) -> str | None:
        """The misuse that linking ``block`` after ``seen`` would be, or None."""
        self._check_block(block)
        if block is self.fake_free_list_head or block is self.fake_free_list_tail:
            return "sentinel"
        if id(block) in seen:
            return "duplicate"
        if self.oracle.linked(block):
            return "linked"
        if self.pool is not None and block.pool is not self.pool:
            return "other_pool"
        seen.add(id(block))
        return None

    def _misuse(self, method: str, block: Any, kind: str) -> None:
        if self.on_misuse == "raise":
            raise MISUSES[kind](f"{method}(): {kind}: {block!r}")
        self.repairs[kind] += 1

    def _check_block(self, obj: object) -> None:
        if not self.oracle.is_block(obj):
            raise TypeError(f"expected a {self.oracle.block_type.__qualname__}, got {obj!r}")

    def _unlink(self, blocks: list[Any]) -> list[Any]:
        for block in blocks:
            del self.blocks[self.position(block)]
            del self.oracle.owner[id(block)]
        return blocks
