"""Valid random programs run on both twins and the list oracle at once.

Every call's outcome (the block ids returned, or the exception raised) must be
the same in the three, and every queue well formed and holding the oracle's
blocks in its order after every call: on a valid state any difference is a
wrong answer. The programs keep two queues per twin and move blocks between
them, drop detached blocks and whole queues, hold lazy ``iter_blocks_after``
cursors across all of it (a cursor follows a block into the other queue, where
it ends on that queue's tail sentinel), and pass an ``__index__`` and iterables
that call the queue while they are being consumed.

Usage: python -m isolated.fuzz_diff TWIN SEED OPS (TWIN is ignored: both twins run).
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any
from weakref import WeakValueDictionary

from kvqueue import KVCacheBlock

from support.fuzz_common import Outcome, Stats, detached, ids, main, outcome, well_formed
from support.oracle import Oracle
from support.twins import twin

NAMES = ("a", "b")
Op = tuple[Any, ...]


class Index:
    """An ``__index__`` that runs an effect (a call into a queue) first."""

    def __init__(self, value: int, effect: Callable[[], None]) -> None:
        self.value = value
        self.effect = effect

    def __index__(self) -> int:
        self.effect()
        return self.value


def _with_effect(blocks: list[Any], effect: Callable[[], None]) -> Iterator[Any]:
    for i, block in enumerate(blocks):
        yield block
        if i == 0:
            effect()


class World:
    """One twin's queues, cursors and detached blocks (or the oracle's), named by
    the program's ops."""

    def __init__(self, mod: Any) -> None:
        self.mod = mod  # a twin, or the oracle
        self.live: WeakValueDictionary[int, Any] = WeakValueDictionary()
        self.pool: dict[int, Any] = {}
        self.queues: dict[str, Any] = {}
        self.cursors: dict[int, Iterator[Any]] = {}

    def make(self, block_id: int) -> Any:
        block = KVCacheBlock(block_id)
        self.live[block_id] = block
        return block

    def effect(self, effect: Op) -> Callable[[], None]:
        def run() -> None:
            if effect[0] == "append_fresh":
                self.queues[effect[1]].append(self.make(effect[2]))
            else:  # "popleft_keep"
                block = self.queues[effect[1]].popleft()
                self.pool[block.block_id] = block

        return run

    def batch(self, block_ids: list[int], form: str, effect: Op | None) -> Iterable[Any]:
        blocks = [self.pool.pop(i) for i in block_ids]
        if form == "tuple":
            return tuple(blocks)
        if form == "iterator":
            return iter(blocks)
        if effect is not None:
            return _with_effect(blocks, self.effect(effect))
        return blocks

    def run(self, op: Op) -> Outcome:
        kind, args = op[0], op[1:]
        queues = self.queues
        if kind == "popleft":
            return outcome(queues[args[0]].popleft)
        if kind == "popleft_n":
            name, n, effect = args
            count = n if effect is None else Index(n, self.effect(effect))
            return outcome(lambda: queues[name].popleft_n(count))
        if kind == "remove":
            block = self.live[args[1]]
            return outcome(lambda: queues[args[0]].remove(block))
        if kind == "append":
            block = self.pool.pop(args[1])
            return outcome(lambda: queues[args[0]].append(block))
        if kind in ("append_n", "prepend_n"):
            name, block_ids, form, effect = args
            batch = self.batch(block_ids, form, effect)
            return outcome(lambda: getattr(queues[name], kind)(batch))
        if kind == "list":
            queue = queues[args[0]]
            return ("listed", ids(queue.get_all_free_blocks()), ids(list(queue)), len(queue))
        if kind == "repr":
            return (repr(queues[args[0]]),)
        if kind == "cursor_new":
            cursor, name, start = args
            self.cursors[cursor] = queues[name].iter_blocks_after(
                None if start is None else self.live[start]
            )
            return ("made",)
        if kind == "cursor_next":
            it = self.cursors[args[0]]
            return ("yielded", [ids(b) for b in islice(it, args[1])])
        if kind == "new":
            for block_id in args[0]:
                self.pool[block_id] = self.make(block_id)
            return ("made",)
        if kind == "drop":
            for block_id in args[0]:
                del self.pool[block_id]
            return ("dropped",)
        if kind == "new_queue":
            name, block_ids = args
            queues[name] = self.mod.FreeKVCacheBlockQueue([self.pool.pop(i) for i in block_ids])
            return ("made",)
        if kind == "collect":
            gc.collect()
            return ("collected",)
        raise AssertionError(f"unknown op {kind}")

    def check(self, oracle: World) -> None:
        """A twin's world: well formed, and holding the oracle's blocks in its order."""
        for name, queue in self.queues.items():
            why = well_formed(queue)
            assert why is None, f"{self.mod.__name__} queue {name}: {why}"
            expected = ids(oracle.queues[name].get_all_free_blocks())
            assert ids(queue.get_all_free_blocks()) == expected, f"queue {name}"
        assert detached(self.pool.values())


class Programs:
    """A program's operations, drawn one at a time from the state of the oracle's world."""

    def __init__(self, rng: random.Random, world: World) -> None:
        self.rng = rng
        self.world = world
        self.next_id = 0

    def fresh(self, count: int) -> list[int]:
        self.next_id += count
        return list(range(self.next_id - count, self.next_id))

    def queue(self, name: str) -> list[int]:
        blocks: list[int] = ids(self.world.queues[name].get_all_free_blocks())
        return blocks

    @property
    def pool(self) -> list[int]:
        return list(self.world.pool)

    def take(self, most: int) -> list[int]:
        pool = self.pool
        return self.rng.sample(pool, self.rng.randint(0, min(most, len(pool))))

    def effect(self) -> Op | None:
        rng = self.rng
        if rng.random() < 0.6:
            return None
        name = rng.choice(NAMES)
        if self.queue(name) and rng.random() < 0.5:
            return ("popleft_keep", name)
        return ("append_fresh", name, self.fresh(1)[0])

    def generate(self) -> Op:
        rng = self.rng
        name = rng.choice(NAMES)
        queue = self.queue(name)
        pool = self.pool
        roll = rng.random()
        if roll < 0.12:
            return ("popleft", name)
        if roll < 0.27:
            return ("popleft_n", name, rng.randint(0, len(queue) + 1), self.effect())
        if roll < 0.37 and queue:
            return ("remove", name, rng.choice(queue))
        if roll < 0.47 and pool:
            return ("append", name, rng.choice(pool))
        if roll < 0.67:
            kind = rng.choice(("append_n", "prepend_n"))
            form = rng.choice(("list", "tuple", "iterator", "generator"))
            effect = self.effect() if form == "generator" else None
            return (kind, name, self.take(6), form, effect)
        if roll < 0.72:
            return (rng.choice(("list", "repr")), name)
        if roll < 0.77:
            cursor = rng.randrange(4)
            start = rng.choice([None, *queue[:3], *queue[-2:], *pool[:1]])
            return ("cursor_new", cursor, name, start)
        if roll < 0.87 and self.world.cursors:
            return ("cursor_next", rng.choice(list(self.world.cursors)), rng.randint(1, 3))
        if roll < 0.92:
            return ("new", self.fresh(rng.randint(1, 4)))
        if roll < 0.96 and pool:
            return ("drop", self.take(3))
        if roll < 0.98:
            return ("new_queue", name, self.take(8))
        return ("collect",)


def program(_: str, seed: int, ops: int) -> Stats:
    oracle = World(Oracle(KVCacheBlock))
    twins = [World(twin("cython")), World(twin("python"))]
    programs = Programs(random.Random(seed), oracle)
    for op in setup(programs):
        for world in (oracle, *twins):
            world.run(op)
    stats = {"ops": 0, "raised": 0, "effects": 0}
    for step in range(ops):
        op = programs.generate()
        # One process, one heap: the twins' collections are the oracle's.
        expected = ("collected",) if op[0] == "collect" else oracle.run(op)
        got = [world.run(op) for world in twins]
        context = f"seed {seed} step {step}: {op}"
        assert got[0] == got[1], f"{context}: twins differ: {got}"
        # The oracle's messages are its own: a raise agrees on the exception's type.
        agreed = got[0][:2] == expected[:2] if expected[0] == "raised" else got[0] == expected
        assert agreed or op[0] == "repr", f"{context}: {got[0]} != oracle {expected}"
        for world in twins:
            world.check(oracle)
        stats["ops"] += 1
        stats["raised"] += got[0][0] == "raised"
        stats["effects"] += any(isinstance(a, tuple) for a in op[1:])
    return stats


def setup(programs: Programs) -> Iterator[Op]:
    """Twelve blocks, and six of them in each queue (drawn once the first op ran)."""
    yield ("new", programs.fresh(12))
    for name in NAMES:
        yield ("new_queue", name, programs.take(6))


if __name__ == "__main__":
    main(program)
