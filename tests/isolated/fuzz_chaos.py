"""Random programs that misuse the queues in every way a caller can.

They call every method with valid and invalid arguments; assign None, ints,
strings, sentinels, queues, blocks of other queues, of the other twin and of
other classes to any block's links (sentinels included), or delete the links;
drop blocks, queues and cursors while linked; pass an ``__index__`` and
iterables that run the queue, corrupt links or mutate the very list being
consumed; make blocks whose finalizers call back into the queues (with the
collector running at nearly every allocation); build queues of block classes
whose constructor calls into half-built queues; and advance ``iter_blocks_after``
cursors across all of it. Queues are built under both misuse policies (and
unknown ones); every repair is logged, and its record formatted, so that the
repr of any block in any state goes through the log. The program must end
normally: an exception from a call is fine, a crash or a hang is not.

On both twins, a call that changes the links of a queue whose list was well
formed leaves it well formed, raised or returned, repaired or not, when no
hook ran during it: a repair never corrupts the list.

On the compiled twin it also checks exception safety on these invalid
states: a call that raises, while no hook of the program ran during it,
leaves every link and count it can see exactly as it was.

Usage: python -m isolated.fuzz_chaos TWIN SEED OPS
"""

from __future__ import annotations

import copy
import gc
import logging
import pickle
import random
from collections.abc import Callable, Iterator
from contextlib import suppress
from itertools import islice
from typing import Any

from kvqueue import KVCacheBlock, _log

from support.blocks import VllmStyleBlock
from support.fuzz_common import Stats, main, well_formed
from support.twins import twin

LINKS = ("prev_free_block", "next_free_block")
MISSING = object()
HOOKS = [0]  # bumped whenever a hook of the program runs: snapshots are void then
STATE: dict[str, Any] = {}  # what the hooks reach: the Chaos object, the batch being consumed
POLICIES = (None, "raise", "repair", "repair", "repair", "bogus")
# The calls that change their queue's links, by the roll that picks them.
MUTATORS = ("popleft", "popleft_n", "remove", "append", "append_n", "prepend_n")


class Formatting(logging.Handler):
    """Formats every record, as a real handler would, and counts it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.unrenderable = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.format(record)
        except Exception:
            # A block whose links the program set to a non-block has a repr
            # that raises (KVCacheBlock's reads the neighbours' block_id):
            # that is the block's failure. Any other is the record's own.
            try:
                [repr(arg) for arg in record.args or ()]
            except Exception:
                self.unrenderable += 1
                return
            self.handleError(record)  # writes to stderr: the run fails
        self.count += 1


class Sub(KVCacheBlock):
    __slots__ = ("extra",)


class Finalized(KVCacheBlock):
    """A block whose finalizer runs a random chaos action."""

    __slots__ = ("me",)

    def __del__(self) -> None:
        HOOKS[0] += 1
        chaos = STATE.get("chaos")
        if chaos is not None and chaos.depth < 2:
            chaos.hook_action()


class Sneaky(KVCacheBlock):
    """A block class whose constructor (also run for a new queue's sentinels)
    calls every queue the collector knows of, half-built ones included."""

    __slots__ = ()

    def __init__(self, block_id: int, **kwargs: Any) -> None:
        super().__init__(block_id, **kwargs)
        HOOKS[0] += 1
        if block_id == -1:
            for obj in gc.get_objects():
                if type(obj).__name__ == "FreeKVCacheBlockQueue":
                    for call in (obj.popleft, obj.get_all_free_blocks, obj.__iter__, obj.__repr__):
                        with suppress(Exception):
                            call()


class Loud:
    """A non-block whose repr (run when an error message names it) runs a hook."""

    def __repr__(self) -> str:
        HOOKS[0] += 1
        chaos = STATE.get("chaos")
        if chaos is not None and chaos.depth < 2:
            chaos.hook_action()
        return "Loud()"


class Index:
    """An ``__index__`` that runs a chaos action, then returns a count or raises."""

    def __init__(self, value: int | None) -> None:
        self.value = value

    def __index__(self) -> int:
        HOOKS[0] += 1
        STATE["chaos"].hook_action()
        if self.value is None:
            raise OverflowError("no index")
        return self.value


class ListSub(list[Any]):
    """A list subclass whose iteration runs a hook."""

    def __iter__(self) -> Iterator[Any]:
        HOOKS[0] += 1
        STATE["chaos"].hook_action()
        return super().__iter__()


def _consumed(items: list[Any], rng: random.Random) -> Iterator[Any]:
    """Yield ``items`` while hooks run and the list itself is mutated."""
    chaos = STATE["chaos"]
    for item in items:
        yield item
        HOOKS[0] += 1
        roll = rng.random()
        if roll < 0.3:
            chaos.hook_action()
        elif roll < 0.4 and items:
            items.pop()
        elif roll < 0.5:
            items.append(chaos.thing())
        elif roll < 0.55:
            raise LookupError("iterable failed")


class Chaos:
    def __init__(self, twin_name: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.mod = twin(twin_name)
        try:  # queues of the other twin share the blocks
            self.other = twin("python" if twin_name == "cython" else "cython")
        except ImportError:  # a pure build has no compiled twin to mix in
            self.other = self.mod
        self.strict = twin_name == "cython"
        self.blocks: list[Any] = []
        self.queues: list[Any] = []
        self.cursors: list[Iterator[Any]] = []
        self.depth = 0
        self.target: Any = None  # the queue of the call being made
        self.method = ""  # the name of the call being made
        self.argument: Any = None  # the block it is given, if one
        self.stats = {"ops": 0, "raised": 0, "hooks": 0, "safety_checks": 0, "whole_checks": 0}
        STATE["chaos"] = self
        while len(self.queues) < 3:
            self.new_queue()

    # -- what the program passes around ---------------------------------------

    def block(self) -> Any:
        rng = self.rng
        if self.blocks and rng.random() < 0.7:
            return rng.choice(self.blocks)
        if self.queues and rng.random() < 0.5:
            queue = rng.choice(self.queues)
            return rng.choice((queue.fake_free_list_head, queue.fake_free_list_tail))
        cls = rng.choice((KVCacheBlock, Sub, Finalized, VllmStyleBlock))
        block: Any = cls(block_id=rng.randrange(100))
        if cls is Finalized and rng.random() < 0.5:
            block.me = block
        self.blocks.append(block)
        return block

    def thing(self) -> Any:
        rng = self.rng
        roll = rng.random()
        if roll < 0.6:
            return self.block()
        return rng.choice(
            (
                None,
                0,
                -1,
                2**70,
                "block",
                Loud(),
                object(),
                self.queues[0] if self.queues else None,
                self.cursors[0] if self.cursors else None,
            )
        )

    def batch(self) -> Any:
        rng = self.rng
        items = [
            self.thing() if rng.random() < 0.2 else self.block() for _ in range(rng.randrange(7))
        ]
        if items and rng.random() < 0.2:
            items.append(rng.choice(items))  # a duplicate
        STATE["batch"] = items
        form = rng.randrange(7)
        if form == 0:
            return tuple(items)
        if form == 1:
            return _consumed(items, rng)
        if form == 2:
            return ListSub(items)
        if form == 3:
            return rng.choice((None, 5, Loud(), "ab", {1: 2}))
        return items

    def count(self, queue: Any) -> Any:
        rng = self.rng
        roll = rng.random()
        size = max(queue.num_free_blocks, 0)  # misuse can drive the count negative
        if roll < 0.6:
            return rng.randint(-2, size + 2)
        if roll < 0.8:
            return Index(rng.choice((None, 0, 1, size, size + 1, -1)))
        return rng.choice((True, 2**63, -(2**63) - 1, 1.5, None, "1"))

    # -- actions ----------------------------------------------------------------

    def new_queue(self) -> None:
        rng = self.rng
        mod = self.other if rng.random() < 0.2 else self.mod
        roll = rng.random()
        if roll < 0.5:
            block_type: Any = rng.choice((None, KVCacheBlock, Sub, Finalized, VllmStyleBlock))
        elif roll < 0.7:
            block_type = Sneaky
        else:
            block_type = rng.choice((int, object, "x", None, type(self), Loud))
        on_misuse = rng.choice(POLICIES)
        try:
            self.queues.append(
                mod.FreeKVCacheBlockQueue(self.batch(), block_type=block_type, on_misuse=on_misuse)
            )
        except Exception:
            self.stats["raised"] += 1
        del self.queues[:-5]

    def corrupt(self) -> None:
        rng = self.rng
        if rng.random() < 0.05:  # a count assigned as vLLM's tests do
            queue = rng.choice(self.queues)
            with suppress(Exception):
                queue.num_free_blocks = rng.choice((0, -1, 2**70, queue.num_free_blocks, "1", None))
            return
        target = self.block()
        name = rng.choice(LINKS)
        if rng.random() < 0.15:
            with suppress(AttributeError):  # already deleted
                delattr(target, name)
        else:
            setattr(target, name, self.thing())

    def call(self) -> Callable[[], Any]:
        """A random call on a random queue, arguments made before it runs."""
        rng = self.rng
        queue: Any = rng.choice(self.queues)
        roll = rng.randrange(13)
        call, argument = self.make_call(queue, roll)
        # Recorded last: making the arguments can run hooks that make calls too.
        self.target, self.argument = queue, argument
        self.method = MUTATORS[roll] if roll < len(MUTATORS) else ""
        return call

    def make_call(self, queue: Any, roll: int) -> tuple[Callable[[], Any], Any]:
        """Call number ``roll`` on ``queue``, and the block it is given, if one."""
        rng = self.rng
        if roll == 0:
            return lambda: queue.popleft(), None
        if roll == 1:
            n = self.count(queue)
            return lambda: queue.popleft_n(n), None
        if roll in (2, 3):
            block = self.thing()
            method = getattr(queue, MUTATORS[roll])
            return lambda: method(block), block
        if roll in (4, 5):
            blocks = self.batch()
            method = getattr(queue, MUTATORS[roll])
            return lambda: method(blocks), None
        if roll == 6:
            return lambda: queue.get_all_free_blocks(), None
        if roll == 7:
            start = self.thing() if rng.random() < 0.7 else None
            return lambda: self.cursors.append(queue.iter_blocks_after(start)), None
        if roll == 8 and self.cursors:
            cursor = rng.choice(self.cursors)
            return lambda: list(islice(cursor, 5)), None
        if roll == 9:
            return lambda: (len(queue), repr(queue), list(islice(queue, 50))), None
        if roll == 10 and self.cursors and self.strict:
            # The cursor type is reachable from Python: build one by hand.
            start = self.thing()
            cursor_type: Any = type(self.cursors[0])
            return lambda: self.cursors.append(cursor_type(queue, start)), None
        if roll == 12:
            thing = rng.choice((queue, self.thing()))
            copier = rng.choice((copy.copy, copy.deepcopy, pickle.dumps))
            return lambda: copier(thing), None
        blocks = self.batch()
        return lambda: type(queue).__new__(type(queue), blocks), None

    def hook_action(self) -> None:
        """What a hook does while the program's call runs: anything at all."""
        if self.depth >= 3:
            return
        self.depth += 1
        try:
            roll = self.rng.random()
            if roll < 0.4:
                self.call()()
            elif roll < 0.6:
                self.corrupt()
            elif roll < 0.7:
                batch = STATE.get("batch")
                if batch:
                    batch.clear() if self.rng.random() < 0.5 else batch.append(self.thing())
            # Drop references (maybe the last) without shrinking the lists: the
            # program may be between choosing an index and using it.
            elif roll < 0.8 and self.blocks:
                for i in range(self.rng.randrange(len(self.blocks))):
                    self.blocks[i] = self.blocks[-1]
            elif roll < 0.9:
                self.queues[self.rng.randrange(len(self.queues))] = self.queues[0]
            else:
                gc.collect()
        except Exception:
            pass
        finally:
            self.depth -= 1

    def step(self) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.02:
            gc.set_threshold(rng.choice((1, 2, 5, 700)))
        elif roll < 0.05:
            gc.collect()
        elif roll < 0.1:
            del self.blocks[: rng.randrange(len(self.blocks) + 1)]
        elif roll < 0.13 and len(self.queues) > 1:
            self.queues.pop(rng.randrange(len(self.queues)))
        elif roll < 0.16:
            del self.cursors[: rng.randrange(len(self.cursors) + 1)]
        elif roll < 0.3:
            self.corrupt()
        elif roll < 0.35:
            self.new_queue()
        else:
            self.checked(self.call())
        while not self.queues:
            self.new_queue()
        del self.blocks[:-60], self.cursors[:-6]

    def checked(self, call: Callable[[], Any]) -> None:
        """Run ``call``; on the compiled twin, a failure must change nothing;
        on both, a list it changes stays whole."""
        hooks = HOOKS[0]
        # The pure twin does not check the links it follows: only the compiled
        # one promises to change nothing when the list is corrupted.
        compiled = self.strict and isinstance(self.target, self.mod.FreeKVCacheBlockQueue)
        before = self.snapshot() if compiled else None
        whole = self.whole_before()
        try:
            call()
        except Exception:
            self.stats["raised"] += 1
            if before is not None:
                after = self.snapshot()
                if HOOKS[0] == hooks:
                    self.stats["safety_checks"] += 1
                    assert after[0] == before[0], "a failing call changed the state"
        if whole and HOOKS[0] == hooks:
            self.stats["whole_checks"] += 1
            problem = _well_formed(self.target)
            assert problem is None, f"{self.method}() on a whole list left it: {problem}"

    def whole_before(self) -> bool:
        """Whether the call about to run must leave its queue's list whole: it
        is whole now, and the call can only reach that list."""
        if not self.method or _well_formed(self.target) is not None:
            return False
        if self.method != "remove":
            return True
        # A block linked elsewhere (or by corrupted links) is taken out of a
        # list that is not this one's: the documented pool=None limitation.
        block = self.argument
        try:
            links = [getattr(block, name) for name in LINKS]
        except AttributeError:
            return True
        return links == [None, None] or any(b is block for b in _walk(self.target))

    def snapshot(self) -> tuple[list[int], list[Any]]:
        """Every count and link the program can see, by identity (``==`` on a
        dataclass block would walk the links), and the objects, held so that
        no id is reused before the comparison."""
        held: list[Any] = [*self.queues, *self.blocks]
        for queue in self.queues:
            held += [queue.fake_free_list_head, queue.fake_free_list_tail]
        links = [getattr(b, name, MISSING) for b in held[len(self.queues) :] for name in LINKS]
        counts = [queue.num_free_blocks for queue in self.queues]
        return counts + [id(x) for x in held + links], held + links


def _well_formed(queue: Any) -> str | None:
    """fuzz_common.well_formed, for a list whose links may have been deleted."""
    try:
        return well_formed(queue, limit=1000)
    except AttributeError as exc:
        return str(exc)


def _walk(queue: Any) -> list[Any]:
    """The blocks of a whole list (see _well_formed), without the queue's iterator."""
    blocks = []
    curr = queue.fake_free_list_head.next_free_block
    while curr is not queue.fake_free_list_tail:
        blocks.append(curr)
        curr = curr.next_free_block
    return blocks


def program(twin_name: str, seed: int, ops: int) -> Stats:
    # Every repair logged (not only the first of each minute) and formatted.
    _log._BURST = ops * 1000
    logger = logging.getLogger("kvqueue")
    handler = Formatting()
    logger.addHandler(handler)
    chaos = Chaos(twin_name, seed)
    for _ in range(ops):
        chaos.step()
        chaos.stats["ops"] += 1
    chaos.stats["hooks"] = HOOKS[0]
    chaos.stats["repairs_logged"] = handler.count
    chaos.stats["repairs_unrenderable"] = handler.unrenderable
    stats = chaos.stats
    STATE.clear()
    gc.set_threshold(700)
    del chaos
    gc.collect()
    return stats


if __name__ == "__main__":
    main(program)
