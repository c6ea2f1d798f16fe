"""A twin's queue driven in step with the oracle's: call by call (``Mirror``, which
test_stateful's rules use) or by a seeded random program (``Program``, test_model's,
which test_repair_model extends)."""

from __future__ import annotations

import random
from collections.abc import Callable
from operator import is_
from types import ModuleType
from typing import Any

from kvqueue import KVCacheBlock

from support.helpers import check_queue, raises_said, snapshot
from support.oracle import Oracle

POOL = 32


def _same(got: Any, expected: Any) -> bool:
    """The same block, or list of blocks, by identity (None: the same None)."""
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(is_, got, expected))
    return got is expected


def _answer(call: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, Exception | None]:
    """What ``call(*args)`` returned, or the exception it raised."""
    try:
        return call(*args), None
    except Exception as exc:
        return None, exc


class Mirror:
    """A twin's queue and the oracle's, of the same blocks, called together."""

    def __init__(
        self, queue_mod: ModuleType, oracle: Oracle, blocks: list[Any], on_misuse: str = "raise"
    ) -> None:
        self.blocks = blocks
        self.oracle = oracle
        self.queue: Any = queue_mod.FreeKVCacheBlockQueue(blocks, on_misuse=on_misuse)
        sentinels = (self.queue.fake_free_list_head, self.queue.fake_free_list_tail)
        self.expected = oracle.FreeKVCacheBlockQueue(
            blocks, on_misuse=on_misuse, sentinels=sentinels
        )

    @property
    def free(self) -> list[Any]:
        return self.expected.blocks

    @property
    def used(self) -> list[Any]:
        """The blocks the program holds: in no queue."""
        return [b for b in self.blocks if not self.oracle.linked(b)]

    def call(
        self,
        method: str,
        *args: Any,
        raises: type[Exception] | None = None,
        match: str | None = None,
    ) -> None:
        """``method`` on both: the same blocks returned, or the same exception raised
        with nothing changed. ``raises``: the exception the call must raise;
        ``match``: what the twin's message must say."""
        expected, refusal = _answer(getattr(self.expected, method), args)
        if refusal is None:
            assert raises is None, f"{method}{args} did not raise {raises.__name__}"
            result = getattr(self.queue, method)(*args)
            assert _same(result, expected), (method, args, result, expected)
            return
        assert raises is None or type(refusal) is raises, f"{method}{args}: {refusal!r}"
        before = snapshot(self.queue, self.blocks)
        with raises_said(type(refusal), match or "") as got:
            getattr(self.queue, method)(*args)
        assert type(got.value) is type(refusal), (got.value, refusal)
        assert snapshot(self.queue, self.blocks) == before

    def cursor(self, start: Any) -> Callable[[], None]:
        """``iter_blocks_after(start)`` on both: a step that asserts they yield alike."""
        got, expected = self.queue.iter_blocks_after(start), self.expected.iter_blocks_after(start)

        def step() -> None:
            block = next(expected, None)
            assert next(got, None) is block, block

        return step

    def check(self) -> None:
        """The queue holds the oracle's blocks in its order (every invariant of
        ``check_queue``) and counted its repairs."""
        check_queue(self.queue, self.expected.blocks, self.blocks)
        assert self.queue.repairs == self.expected.repairs


class Program:
    """Seeded random calls on one queue: valid ones, misuse that must raise, and a
    lazy cursor held across them. ``check`` after every ``step``."""

    def __init__(
        self,
        queue_mod: ModuleType,
        rng: random.Random,
        on_misuse: str = "raise",
        pool: object = None,
    ) -> None:
        self.rng = rng
        self.oracle = Oracle(KVCacheBlock)
        self.blocks = [KVCacheBlock(i, pool=pool) for i in range(POOL)]
        self.mirror = Mirror(queue_mod, self.oracle, self.blocks, on_misuse)
        self.queue = self.mirror.queue
        self.call = self.mirror.call
        self.new_cursor()

    @property
    def free(self) -> list[Any]:
        return self.mirror.free

    @property
    def used(self) -> list[Any]:
        return self.mirror.used

    def take(self, least: int, most: int) -> list[Any]:
        """From ``least`` to ``most`` of the blocks the program holds."""
        used = self.used
        return self.rng.sample(used, self.rng.randint(least, min(most, len(used))))

    def new_cursor(self) -> None:
        self.advance_cursor = self.mirror.cursor(self.rng.choice([None, *self.free[:4]]))

    def step(self) -> None:
        rng, call = self.rng, self.call
        op = rng.randrange(14)
        if op == 0:
            call("popleft")
        elif op in (1, 2):
            call("popleft_n", rng.choice([1, 1, 1, 2, 3, 8]))
        elif op == 3 and self.free:
            call("remove", rng.choice(self.free))
        elif op in (4, 5) and self.used:
            call("append", rng.choice(self.used))
        elif op in (6, 7) and self.used:
            call("append_n", self.take(1, 4))
        elif op == 8 and self.used:
            call("prepend_n", self.take(1, 4))
        elif op == 9:
            self.invalid_call()
        elif op == 10:
            self.new_cursor()
        else:
            self.advance_cursor()

    def invalid_call(self) -> None:
        rng, call, free, used = self.rng, self.call, self.free, self.used
        choice = rng.randrange(5)
        if choice == 0 and free:
            call("append", rng.choice(free), raises=ValueError)
        elif choice == 1 and used:
            call("remove", rng.choice(used), raises=RuntimeError)
        elif choice == 2 and used:
            call("append_n", [*used[:3], used[0]], raises=ValueError)
        elif choice == 3 and used and free:
            call("prepend_n", [*used[:2], rng.choice(free)], raises=ValueError)
        else:
            call("append_n", [*used[:2], None], raises=TypeError)

    def check(self) -> None:
        self.mirror.check()
