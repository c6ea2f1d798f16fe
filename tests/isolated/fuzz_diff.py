"""Valid random programs run on both twins and a list model at once.

Every call's outcome (the block ids returned, or the exception raised) must be
the same in the three, and every queue well formed after every call: on a valid
state any difference is a wrong answer. The programs keep two queues per twin
and move blocks between them, drop detached blocks and whole queues, hold lazy
``iter_blocks_after`` cursors across all of it (a cursor follows a block into
the other queue, where it ends on that queue's tail sentinel), and pass an
``__index__`` and iterables that call the queue while they are being consumed.

Usage: python fuzz_diff.py TWIN SEED OPS (TWIN is ignored: both twins run).
"""

from __future__ import annotations

import support_path  # noqa: F401  (this program runs as a script)

# isort: split

import gc
import random
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any
from weakref import WeakValueDictionary

from fuzz_common import Outcome, Stats, detached, ids, main, outcome, well_formed
from twins import twin

from kvqueue import KVCacheBlock

NAMES = ("a", "b")
# A cursor's position: ("head", own queue key), ("block", block id, own queue
# key), ("sentinel",) once it went past into another queue, or None: exhausted.
Position = tuple[Any, ...] | None
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
    """One twin's queues, cursors and detached blocks, named as in the model."""

    def __init__(self, twin_name: str) -> None:
        self.mod = twin(twin_name)
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

    def check(self) -> None:
        for name, queue in self.queues.items():
            why = well_formed(queue)
            assert why is None, f"{self.mod.__name__} queue {name}: {why}"
        assert detached(self.pool.values())


class Model:
    """The same program on plain lists; also generates the next operation."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.next_id = 0
        self.next_key = 0
        self.lists: dict[int, list[int]] = {}  # every queue ever made, by key
        self.current: dict[str, int] = {}
        self.pool: list[int] = []
        self.cursors: dict[int, Position] = {}

    def fresh(self, count: int) -> list[int]:
        self.next_id += count
        return list(range(self.next_id - count, self.next_id))

    def queue(self, name: str) -> list[int]:
        return self.lists[self.current[name]]

    def take(self, most: int) -> list[int]:
        return self.rng.sample(self.pool, self.rng.randint(0, min(most, len(self.pool))))

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
        roll = rng.random()
        if roll < 0.12:
            return ("popleft", name)
        if roll < 0.27:
            return ("popleft_n", name, rng.randint(0, len(queue) + 1), self.effect())
        if roll < 0.37 and queue:
            return ("remove", name, rng.choice(queue))
        if roll < 0.47 and self.pool:
            return ("append", name, rng.choice(self.pool))
        if roll < 0.67:
            kind = rng.choice(("append_n", "prepend_n"))
            form = rng.choice(("list", "tuple", "iterator", "generator"))
            effect = self.effect() if form == "generator" else None
            return (kind, name, self.take(6), form, effect)
        if roll < 0.72:
            return (rng.choice(("list", "repr")), name)
        if roll < 0.77:
            cursor = rng.randrange(4)
            start = rng.choice([None, *queue[:3], *queue[-2:], *self.pool[:1]])
            return ("cursor_new", cursor, name, start)
        if roll < 0.87 and self.cursors:
            return ("cursor_next", rng.choice(list(self.cursors)), rng.randint(1, 3))
        if roll < 0.92:
            return ("new", self.fresh(rng.randint(1, 4)))
        if roll < 0.96 and self.pool:
            return ("drop", self.take(3))
        if roll < 0.98:
            return ("new_queue", name, self.take(8))
        return ("collect",)

    def apply_effect(self, effect: Op | None) -> None:
        if effect is None:
            return
        if effect[0] == "append_fresh":
            self.queue(effect[1]).append(effect[2])
        else:
            self.pool.append(self.queue(effect[1]).pop(0))

    def where(self, block_id: int) -> tuple[int, int] | None:
        for key, lst in self.lists.items():
            if block_id in lst:
                return key, lst.index(block_id)
        return None

    def step(self, position: Position) -> tuple[Position, int | None]:
        """A cursor's next position and the id it yields (None: exhausted)."""
        if position is None or position[0] == "sentinel":
            return None, None
        if position[0] == "head":
            lst = self.lists[position[1]]
            return (("block", lst[0], position[1]), lst[0]) if lst else (None, None)
        _, block_id, own = position
        found = self.where(block_id)
        if found is None:  # detached: its next_free_block is None
            return None, None
        key, index = found
        lst = self.lists[key]
        if index + 1 < len(lst):
            return ("block", lst[index + 1], own), lst[index + 1]
        if key == own:  # the cursor's own tail ends it
            return None, None
        return ("sentinel",), -1

    def apply(self, op: Op) -> tuple[Any, ...]:
        """The expected outcome: ids returned, or ("raised", type name)."""
        kind, args = op[0], op[1:]
        if kind == "popleft":
            queue = self.queue(args[0])
            return ("returned", queue.pop(0)) if queue else ("raised", "ValueError")
        if kind == "popleft_n":
            name, n, effect = args
            self.apply_effect(effect)
            queue = self.queue(name)
            if n > len(queue):
                return ("raised", "AssertionError")
            popped = queue[:n]
            del queue[:n]
            return ("returned", popped)
        if kind == "remove":
            self.queue(args[0]).remove(args[1])
            return ("returned", None)
        if kind == "append":
            self.pool.remove(args[1])
            self.queue(args[0]).append(args[1])
            return ("returned", None)
        if kind in ("append_n", "prepend_n"):
            name, block_ids, _, effect = args
            for block_id in block_ids:
                self.pool.remove(block_id)
            if block_ids:
                self.apply_effect(effect)
            queue = self.queue(name)
            queue[len(queue) if kind == "append_n" else 0 : 0] = block_ids
            return ("returned", None)
        if kind == "list":
            queue = self.queue(args[0])
            return ("listed", list(queue), list(queue), len(queue))
        if kind == "cursor_new":
            cursor, name, start = args
            key = self.current[name]
            self.cursors[cursor] = ("head", key) if start is None else ("block", start, key)
            return ("made",)
        if kind == "cursor_next":
            cursor, count = args
            yielded = []
            for _ in range(count):
                self.cursors[cursor], block_id = self.step(self.cursors[cursor])
                if block_id is None:
                    break
                yielded.append(block_id)
            return ("yielded", yielded)
        if kind == "new":
            self.pool.extend(args[0])
            return ("made",)
        if kind == "drop":
            for block_id in args[0]:
                self.pool.remove(block_id)
            return ("dropped",)
        if kind == "new_queue":
            name, block_ids = args
            for block_id in block_ids:
                self.pool.remove(block_id)
            self.new_queue(name, block_ids)
            return ("made",)
        return ("collected",)

    def new_queue(self, name: str, block_ids: list[int]) -> None:
        self.lists[self.next_key] = list(block_ids)
        self.current[name] = self.next_key
        self.next_key += 1


def program(_: str, seed: int, ops: int) -> Stats:
    rng = random.Random(seed)
    model = Model(rng)
    worlds = [World("c"), World("py")]
    setup: list[Op] = [("new", model.fresh(12))]
    model.apply(setup[0])
    for name in NAMES:
        setup.append(("new_queue", name, model.take(6)))
        model.apply(setup[-1])
    for op in setup:
        for world in worlds:
            world.run(op)
    stats = {"ops": 0, "raised": 0, "effects": 0}
    for step in range(ops):
        op = model.generate()
        expected = model.apply(op)
        got = [world.run(op) for world in worlds]
        context = f"seed {seed} step {step}: {op}"
        assert got[0] == got[1], f"{context}: twins differ: {got}"
        if op[0] != "repr":
            assert got[0][: len(expected)] == expected, f"{context}: {got[0]} != model {expected}"
        for world in worlds:
            world.check()
        stats["ops"] += 1
        stats["raised"] += got[0][0] == "raised"
        stats["effects"] += any(isinstance(a, tuple) for a in op[1:])
    return stats


if __name__ == "__main__":
    main(program)
