"""The pool guard's screens (``_screen.pyx`` / ``_screen_py.py``): one suite, both twins,
against an oracle that counts occurrences the slow way."""

from __future__ import annotations

import gc
import inspect
import random
import sys
import tracemalloc
import weakref
from types import ModuleType
from typing import Any, ClassVar

import pytest

from kvqueue import KVCacheBlock

POOL = object()
OTHER = object()


def _block_init(self: Any, ref_cnt: int, *, is_null: bool = False, pool: object = POOL) -> None:
    self.ref_cnt = ref_cnt
    self.is_null = is_null
    self.pool = pool
    self.prev_free_block = None
    self.next_free_block = None


class Block:
    """A vLLM-shaped block, its fields in an instance dict: only what the screens read."""

    ref_cnt: int
    is_null: bool
    pool: object
    prev_free_block: Any
    next_free_block: Any
    __init__ = _block_init


class SlottedBlock:
    """Laid out as vLLM's @dataclass(slots=True) block: the compiled screens read its slots."""

    __slots__ = ("is_null", "next_free_block", "pool", "prev_free_block", "ref_cnt")
    __init__ = _block_init


@pytest.fixture(params=[Block, SlottedBlock], ids=["dict", "slots"])
def block_class(request: pytest.FixtureRequest) -> type:
    return request.param  # type: ignore[no-any-return]


def oracle(blocks: list[Block]) -> int:
    flags = 0
    for i, block in enumerate(blocks):
        if block.pool is not POOL:
            flags |= 1 if block.pool is not None else 4  # OTHER_POOLS, NO_POOL
            continue
        if block.is_null:
            continue
        first = not any(b is block for b in blocks[:i])
        if first and block.prev_free_block is not None:
            return i
        if not first:
            flags |= 2  # REPEATS
        if sum(b is block for b in blocks[: i + 1]) > block.ref_cnt:
            return i
    return -1 - flags


def test_flags_are_the_twins_constants(screen: ModuleType) -> None:
    assert (screen.OTHER_POOLS, screen.REPEATS, screen.NO_POOL) == (1, 2, 4)


@pytest.mark.parametrize("seed", range(100))
def test_first_excess_matches_the_oracle(screen: ModuleType, block_class: type, seed: int) -> None:
    rng = random.Random(seed)
    distinct = [
        block_class(
            rng.choice([-1, 0, 1, 1, 2, 3]),
            is_null=rng.random() < 0.1,
            pool=rng.choice([POOL, POOL, POOL, None, OTHER]),
        )
        for _ in range(rng.randint(1, 12))
    ]
    for block in distinct:
        if rng.random() < 0.1:
            block.prev_free_block = block_class(0)  # linked in a free list
    blocks = [rng.choice(distinct) for _ in range(rng.randint(0, 40))]
    assert screen.first_excess(blocks, POOL) == oracle(blocks)


def test_first_excess_many_copies(screen: ModuleType) -> None:
    block = Block(5)
    blocks = [block] * 20_000
    before = sys.getrefcount(block)
    assert screen.first_excess(blocks, POOL) == 5
    assert screen.first_excess(blocks[:5], POOL) == -1 - screen.REPEATS
    assert sys.getrefcount(block) == before
    assert screen.first_excess([Block(10**30)] * 3, POOL) == -1 - screen.REPEATS
    assert screen.first_excess([Block(1), Block(2)], POOL) == -1


class Shrinking(Block):
    """A block whose ``is_null`` read empties the list being screened."""

    victim: ClassVar[list[Any]] = []

    @property
    def is_null(self) -> bool:
        self.victim.clear()
        return False

    @is_null.setter
    def is_null(self, value: bool) -> None:
        pass


def test_code_run_by_a_block_cannot_crash_a_screen(screen: ModuleType) -> None:
    blocks: list[Any] = [Block(1), Shrinking(1), Block(0), Block(0)]
    Shrinking.victim = blocks
    assert screen.first_excess(blocks, POOL) == -1  # the list ended under it
    assert blocks == []


class Raising(Block):
    @property
    def ref_cnt(self) -> int:
        raise LookupError("ref_cnt")

    @ref_cnt.setter
    def ref_cnt(self, value: int) -> None:
        pass


def test_a_raising_block_raises_through(screen: ModuleType) -> None:
    held = Block(1)
    before = sys.getrefcount(held)
    with pytest.raises(LookupError, match="ref_cnt"):
        screen.first_excess([held, Raising(1)], POOL)
    assert sys.getrefcount(held) == before  # the table's references were given back
    with pytest.raises(LookupError):
        screen.first_negative([Raising(1)], POOL)


def test_first_negative(screen: ModuleType) -> None:
    assert screen.first_negative([], POOL) == -1
    blocks = [Block(0), Block(-1, is_null=True), Block(-1, pool=None), Block(-2)]
    assert screen.first_negative(blocks, POOL) == 3
    assert screen.first_negative([Block(1), Block(0)], POOL) == -1


def test_first_held_free(screen: ModuleType) -> None:
    head, *blocks = [Block(0) for _ in range(5)]
    for left, right in zip([head, *blocks], blocks, strict=False):
        left.next_free_block = right
    assert screen.first_held_free(head, 4) is None
    blocks[2].ref_cnt = 1
    assert screen.first_held_free(head, 2) is None
    assert screen.first_held_free(head, 3) is blocks[2]
    blocks[0].ref_cnt = -1
    assert screen.first_held_free(head, 4) is blocks[0]
    assert screen.first_held_free(head, 0) is None
    blocks[0].ref_cnt = 0
    blocks[2].ref_cnt = 0
    assert screen.first_held_free(head, 10) is None  # past the last link


class _Count(int):
    """A count of an int subclass: read by its value, as vLLM's own could be."""


def test_first_listed(screen: ModuleType) -> None:
    head, *blocks = [Block(0) for _ in range(5)]
    for i, block in enumerate(blocks):
        block.block_id = i
    for left, right in zip([head, *blocks], blocks, strict=False):
        left.next_free_block = right
    counts = [0] * 4  # the last block's id is past the index's counts
    pool_blocks = list(blocks)
    assert screen.first_listed(head, 4, counts, pool_blocks) is None
    counts[2] = 1
    assert screen.first_listed(head, 2, counts, pool_blocks) is None
    assert screen.first_listed(head, 3, counts, pool_blocks) is blocks[2]
    counts[1] = _Count(2)
    assert screen.first_listed(head, 3, counts, pool_blocks) is blocks[1]
    pool_blocks[1] = Block(0)  # another block at its id: not this pool's, not counted
    assert screen.first_listed(head, 3, counts, pool_blocks) is blocks[2]
    counts[1] = counts[2] = 0
    blocks[0].block_id = "first"  # no int: not counted
    blocks[3].block_id = -1
    assert screen.first_listed(head, 10, counts, pool_blocks) is None  # past the last link


def test_first_listed_free(screen: ModuleType) -> None:
    blocks = [Block(0) for _ in range(5)]
    for i, block in enumerate(blocks):
        block.block_id = i
    counts = [0] * 4  # the last block's id is past the index's counts
    pool_blocks = list(blocks)
    assert screen.first_listed_free(blocks, counts, pool_blocks) == -1
    counts[3] = _Count(1)
    assert screen.first_listed_free(blocks, counts, pool_blocks) == 3
    counts[1] = 2
    blocks[1].ref_cnt = 2  # held as often as listed: out of the free list
    assert screen.first_listed_free(blocks, counts, pool_blocks) == 3
    blocks[3].is_null = True  # the null block: listed in many places, never free
    assert screen.first_listed_free(blocks, counts, pool_blocks) == -1
    blocks[1].ref_cnt = 0
    pool_blocks[1] = Block(0)  # another block at its id: not this pool's, not counted
    assert screen.first_listed_free(blocks, counts, pool_blocks) == -1
    pool_blocks[1] = blocks[1]
    assert screen.first_listed_free(blocks[1:2] * 2, counts, pool_blocks) == 0


def test_twins_document_the_same_contract(screen: ModuleType) -> None:
    import kvqueue.vllm._screen_py as pure

    assert screen.__all__ == pure.__all__
    for name in pure.__all__:
        # The compiled docstring starts with its signature (embedsignature).
        doc = inspect.cleandoc(getattr(screen, name).__doc__)
        assert doc.endswith(inspect.cleandoc(getattr(pure, name).__doc__)), name


def test_a_class_changed_during_a_screen_is_read_as_changed(screen: ModuleType) -> None:
    """A block of another class whose ``pool`` read turns the slotted class's ``ref_cnt``
    into a property: the blocks after it read the property, as the pure twin does."""

    class Slotted(SlottedBlock):
        __slots__ = ()

    class Switch(Block):
        @property
        def pool(self) -> object:
            setattr(Slotted, "ref_cnt", property(lambda self: 0))  # noqa: B010
            return POOL

        @pool.setter
        def pool(self, value: object) -> None:
            pass

    blocks: list[Any] = [Slotted(1), Switch(1), Slotted(1)]
    try:
        assert screen.first_excess(blocks, POOL) == 2  # its ref_cnt now reads 0
    finally:
        delattr(Slotted, "ref_cnt")


def test_a_class_changed_between_calls_is_read_as_changed(screen: ModuleType) -> None:
    """The compiled twin keeps the last class's layout from call to call: a class changed
    since (a slot turned into a property) is read as it is now, by every screen and count."""

    class Identified(SlottedBlock):
        __slots__ = ("block_id",)

    class Slotted(Identified):  # its fields shadowed, then its base's again
        __slots__ = ()

    head, block = Slotted(0), Slotted(0)
    head.next_free_block, block.block_id = block, 0
    counts = [0]
    assert screen.first_held_free(head, 1) is None
    screen.count_one(block, [block], counts, 1)
    try:
        Slotted.ref_cnt = property(lambda self: 1)
        Slotted.block_id = property(lambda self: 5)
        assert screen.first_held_free(head, 1) is block
        assert screen.first_negative([block], None) == -1
        screen.count_one(block, [block], counts, 1)  # block 5 is none of the pool's
        assert counts == [1]
    finally:
        del Slotted.ref_cnt, Slotted.block_id
    assert screen.first_held_free(head, 1) is None
    screen.count_one(block, [block], counts, 1)
    assert counts == [2]


def test_an_unset_slot_raises_as_getattr_does(screen: ModuleType) -> None:
    block = SlottedBlock(1)
    del block.ref_cnt
    with pytest.raises(AttributeError, match="ref_cnt"):
        screen.first_excess([block], POOL)
    head = SlottedBlock(0)
    del head.next_free_block
    with pytest.raises(AttributeError, match="next_free_block"):
        screen.first_held_free(head, 1)


class _Pool:
    """A pool as vLLM 0.34+ names it in its blocks: by a weak reference (``_weak_self``)."""


def test_weak_pool_references_as_vllm_0_34_reads_them(
    screen: ModuleType, block_class: type
) -> None:
    """Own blocks by the pool's weak reference are screened; another live pool's raise
    OTHER_POOLS; a block whose pool is gone (free_blocks skips it, unpin_blocks would queue
    it here) and a block of no pool raise NO_POOL: the guard looks at what the call does."""
    mine, theirs, gone = _Pool(), _Pool(), _Pool()
    ref, their_ref, gone_ref = weakref.ref(mine), weakref.ref(theirs), weakref.ref(gone)
    del gone
    assert gone_ref() is None
    own = block_class(1, pool=ref)
    assert screen.first_excess([own], ref) == -1
    assert screen.first_excess([own, own], ref) == 1
    other = block_class(0, pool=their_ref)
    assert screen.first_excess([own, other, other], ref) == -1 - screen.OTHER_POOLS
    orphan = block_class(0, pool=gone_ref)
    assert screen.first_excess([orphan, own, orphan], ref) == -1 - screen.NO_POOL
    assert screen.first_excess([block_class(0, pool=None), own], ref) == -1 - screen.NO_POOL
    # Another weak reference to this very pool is not its _weak_self: vLLM hands it on.
    assert screen.first_excess([block_class(0, pool=weakref.ref(mine, print))], ref) == -2
    assert screen.first_negative([block_class(-1, pool=gone_ref)], ref) == -1
    assert screen.first_negative([block_class(-1, pool=ref)], ref) == 0


def test_only_an_exact_weak_reference_is_called(screen: ModuleType, block_class: type) -> None:
    """A pool field of another callable type is never called by a screen: flagged, to the
    guard and vLLM."""
    calls = []

    class Ref(weakref.ref):  # type: ignore[type-arg]
        def __call__(self) -> Any:
            calls.append(self)
            return None

    mine = _Pool()
    odd = block_class(0, pool=Ref(mine))
    assert screen.first_excess([odd], weakref.ref(mine)) == -1 - screen.OTHER_POOLS
    assert calls == []


# -- the holder index's counts ---------------------------------------------------------------


class _Id(int):
    """A block id of an int subclass: not an int exactly, never counted."""


class _Loud(int):
    """An id whose ``__index__`` and ``__eq__`` would record a call: the counts run neither."""

    calls: ClassVar[list[str]] = []

    def __index__(self) -> int:
        self.calls.append("__index__")
        return 0

    def __eq__(self, other: object) -> bool:
        self.calls.append("__eq__")
        return True

    __hash__ = int.__hash__


class Identified:
    """A block as the holder index reads it: its ``block_id`` alone."""

    def __init__(self, block_id: Any) -> None:
        self.block_id = block_id

    def __eq__(self, other: object) -> bool:
        raise AssertionError("the counts compare blocks by identity")

    __hash__ = object.__hash__


class SlottedId:
    """Laid out as vLLM's @dataclass(slots=True) block: the compiled counts read the slot."""

    __slots__ = ("block_id",)

    def __init__(self, block_id: Any) -> None:
        self.block_id = block_id


@pytest.fixture(params=[Identified, SlottedId], ids=["dict", "slots"])
def id_class(request: pytest.FixtureRequest) -> type:
    return request.param  # type: ignore[no-any-return]


def counted(blocks: list[Any], pool_blocks: list[Any], counts: list[int], step: int) -> list[int]:
    """What the counts must be after ``blocks`` are counted ``step`` times, the slow way."""
    counts = list(counts)
    for block in blocks:
        block_id = getattr(block, "block_id", None)
        if type(block_id) is not int or not 0 <= block_id < len(counts):
            continue
        if block_id < len(pool_blocks) and pool_blocks[block_id] is block:
            counts[block_id] += step
    return counts


@pytest.mark.parametrize("seed", range(40))
def test_count_matches_the_oracle(screen: ModuleType, id_class: type, seed: int) -> None:
    rng = random.Random(seed)
    pool_blocks = [id_class(i) for i in range(12)]
    # Another pool's blocks at the same ids, ids of no int exactly or out of range, no id.
    strangers = [id_class(i) for i in range(4)] + [object(), None, Identified("1")]
    strangers += [id_class(b) for b in (True, _Id(2), -1, 12, 2**70, -(2**70), 2**63, 1.0)]
    counts = [0] * 10  # the last two blocks' ids are past the counts
    for _ in range(30):
        blocks = [rng.choice(pool_blocks + strangers) for _ in range(rng.randrange(8))]
        step = rng.choice([1, -1, 3])
        want = counted(blocks, pool_blocks, counts, step)
        made: Any = rng.choice([list, tuple, iter])
        screen.count(made(blocks), pool_blocks, counts, step)
        assert counts == want
        for block in blocks:
            want = counted([block], pool_blocks, counts, -step)
            screen.count_one(block, pool_blocks, counts, -step)
            assert counts == want
        assert counts == [0] * 10


def test_count_runs_no_code_of_an_id_or_a_block(screen: ModuleType, id_class: type) -> None:
    pool_blocks = [id_class(i) for i in range(3)]
    loud = id_class(_Loud(1))
    counts = [0] * 3
    screen.count([loud, *pool_blocks], pool_blocks, counts, 1)
    screen.count_one(loud, pool_blocks, counts, 1)
    assert counts == [1, 1, 1]
    assert _Loud.calls == []


def test_count_keeps_every_reference(screen: ModuleType, id_class: type) -> None:
    pool_blocks = [id_class(i) for i in range(3)]
    huge = 2**70
    odd = id_class(huge)
    blocks = [*pool_blocks, odd] * 50
    before = [sys.getrefcount(x) for x in (blocks, pool_blocks[1], odd, huge)]
    counts = [0] * 3
    for _ in range(20):
        screen.count(blocks, pool_blocks, counts, 1)
        screen.count(blocks, pool_blocks, counts, -1)
        screen.count_one(pool_blocks[1], pool_blocks, counts, 1)
        screen.count_one(pool_blocks[1], pool_blocks, counts, -1)
        screen.count_one(odd, pool_blocks, counts, 1)
    assert counts == [0, 0, 0]
    assert [sys.getrefcount(x) for x in (blocks, pool_blocks[1], odd, huge)] == before


class RaisingId:
    """A block whose ``block_id`` read raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    @property
    def block_id(self) -> int:
        raise self.error


def test_a_raising_block_id_raises_through_the_counts(screen: ModuleType) -> None:
    """An AttributeError reads as no id, as ``getattr(block, "block_id", None)`` has it; any
    other error raises through, the blocks before it counted."""
    pool_blocks = [Identified(i) for i in range(3)]
    counts = [0] * 3
    missing = RaisingId(AttributeError("block_id"))
    screen.count([missing, pool_blocks[0]], pool_blocks, counts, 1)
    screen.count_one(missing, pool_blocks, counts, 1)
    assert counts == [1, 0, 0]
    broken = RaisingId(LookupError("block_id"))
    with pytest.raises(LookupError, match="block_id"):
        screen.count([pool_blocks[1], broken, pool_blocks[2]], pool_blocks, counts, 1)
    assert counts == [1, 1, 0]
    with pytest.raises(LookupError, match="block_id"):
        screen.count_one(broken, pool_blocks, counts, 1)
    with pytest.raises(LookupError, match="block_id"):
        screen.suspects([[broken]], counts, pool_blocks)
    with pytest.raises(LookupError, match="block_id"):
        screen.first_under_listed([broken], counts, pool_blocks)


class Meddling:
    """A block whose ``block_id`` read runs ``meddle`` first, then gives ``block_id``."""

    def __init__(self, block_id: int, meddle: Any) -> None:
        self._id = block_id
        self.meddle = meddle

    @property
    def block_id(self) -> int:
        self.meddle()
        return self._id


def test_lists_changed_by_a_block_id_read_cannot_crash_the_counts(screen: ModuleType) -> None:
    pool_blocks: list[Any] = [Identified(i) for i in range(4)]
    counts = [0] * 4
    shrinking = Meddling(3, counts.clear)
    pool_blocks[3] = shrinking
    screen.count([pool_blocks[0], shrinking, pool_blocks[1]], pool_blocks, counts, 1)
    assert counts == []  # emptied under the call: nothing after it is counted
    counts[:] = [0] * 4
    gone = Meddling(3, lambda: pool_blocks.__delitem__(slice(2, None)))
    pool_blocks[3] = gone
    screen.count_one(gone, pool_blocks, counts, 1)
    assert counts == [0] * 4  # its id is past the pool's blocks now
    # A block appended while the list is counted is counted, as iterating it reaches it.
    pool_blocks[:] = [Identified(i) for i in range(4)]
    blocks: list[Any] = []
    growing = Meddling(0, lambda: blocks.append(pool_blocks[1]) if len(blocks) < 3 else None)
    pool_blocks[0] = growing
    blocks.append(growing)
    screen.count(blocks, pool_blocks, counts, 1)
    assert counts == [1, 1, 0, 0]
    assert len(blocks) == 2


class Shrinks:
    """A count whose addition empties the counts it is in."""

    def __init__(self, counts: list[Any]) -> None:
        self.counts = counts

    def __iadd__(self, step: int) -> int:
        self.counts.clear()
        return step


def test_a_count_whose_addition_empties_the_counts_raises(screen: ModuleType) -> None:
    pool_blocks = [Identified(0)]
    counts: list[Any] = []
    counts.append(Shrinks(counts))
    with pytest.raises(IndexError, match="list assignment index out of range"):
        screen.count_one(pool_blocks[0], pool_blocks, counts, 1)
    counts.append(Shrinks(counts))
    with pytest.raises(IndexError, match="list assignment index out of range"):
        screen.count(pool_blocks, pool_blocks, counts, 1)


def test_looks_free_reads_what_a_free_block_shows(screen: ModuleType, block_class: type) -> None:
    """A block may be in a free list unless it is null, or holds a reference (an int above 0,
    exactly) and is linked in no list."""
    block = block_class(1)
    assert not screen.looks_free(block)
    block.prev_free_block = block_class(1)  # linked: held, yet in a free list
    assert screen.looks_free(block)
    block.prev_free_block = None
    for refs in (0, -1, True, 1.0, "1", None):
        block.ref_cnt = refs
        assert screen.looks_free(block), refs
    block.is_null = True
    assert not screen.looks_free(block)
    del block.ref_cnt  # a field it lacks reads as none
    block.is_null = False
    assert screen.looks_free(block)


@pytest.mark.parametrize("ref_cnt", [0, 1])
def test_a_block_first_listed_while_it_looks_free_is_loose(
    screen: ModuleType, ref_cnt: int
) -> None:
    """A count from 0 up of a block that looks free puts it in ``loose``; a count from 1
    up, or down, or of a held block, does not; the counts move alike."""
    pool_blocks = [KVCacheBlock(i) for i in range(4)]
    for block in pool_blocks:
        block.ref_cnt = ref_cnt
    counts, loose = [0, 0, 0, 0], list[Any]()
    screen.count(pool_blocks[:2], pool_blocks, counts, 1, loose)
    screen.count_one(pool_blocks[2], pool_blocks, counts, 1, loose)
    screen.count(pool_blocks[:3], pool_blocks, counts, 1, loose)  # from 1 up: not again
    screen.count(pool_blocks[:3], pool_blocks, counts, -1, loose)
    screen.count([pool_blocks[3]], pool_blocks, counts, 1)  # no list given
    assert counts == [1, 1, 1, 1]
    assert loose == ([] if ref_cnt else pool_blocks[:3])


# -- the audit's suspects among freed blocks -------------------------------------------------


class Suspect:
    """A freed block as the audit reads it, each read recorded in ``reads``."""

    reads: ClassVar[list[str]] = []

    def __init__(self, block_id: Any, ref_cnt: Any = 0, *, is_null: bool = False) -> None:
        self._fields = {"block_id": block_id, "ref_cnt": ref_cnt, "is_null": is_null}
        self._fields["prev_free_block"] = None

    def __getattr__(self, name: str) -> Any:
        if name not in ("block_id", "ref_cnt", "is_null", "prev_free_block"):
            raise AttributeError(name)
        self.reads.append(name)
        return self.__dict__["_fields"][name]

    def set(self, **fields: Any) -> None:
        self._fields.update(fields)


def test_suspects(screen: ModuleType) -> None:
    pool_blocks = [Suspect(i) for i in range(8)]
    counts: list[Any] = [1, 0, 2, 1, 1, 1, 1, 1]
    held, free, short, odd, null, linked = (pool_blocks[i] for i in (0, 1, 2, 3, 4, 5))
    held.set(ref_cnt=1)  # held as often as listed
    short.set(ref_cnt=1)  # listed twice, one reference
    odd.set(ref_cnt=_Id(5))  # no int exactly
    null.set(is_null=True)
    linked.set(ref_cnt=3, prev_free_block=held)  # in a free list
    stranger = Suspect(0)  # another pool's block at a listed id
    freed = [[held, free], [short, stranger, odd], [null, linked, Suspect(None), Suspect(9)]]
    Suspect.reads.clear()
    assert screen.suspects(freed, counts, pool_blocks) == [short, odd, linked]
    assert Suspect.reads == [
        *("block_id", "is_null", "ref_cnt", "prev_free_block"),  # held
        "block_id",  # free: listed by none
        *("block_id", "is_null", "ref_cnt", "prev_free_block"),  # short
        "block_id",  # stranger
        *("block_id", "is_null", "ref_cnt", "prev_free_block"),  # odd
        *("block_id", "is_null"),  # null
        *("block_id", "is_null", "ref_cnt", "prev_free_block"),  # linked
        "block_id",
        "block_id",
    ]
    assert screen.suspects([], counts, pool_blocks) == []
    assert screen.suspects([[held]], [0] * 8, pool_blocks) == []


def test_first_under_listed(screen: ModuleType) -> None:
    """Before a free: the first block whose one release would leave it fewer references than
    listings (the holder index's), fields read in the order ``block_id``, ``is_null``,
    ``ref_cnt``, only for a listed block of the pool."""
    pool_blocks = [Suspect(i) for i in range(8)]
    counts: list[Any] = [1, 0, 2, 1, 1, 1, 1, 1]
    held, free, shared, odd, null, last = (pool_blocks[i] for i in (0, 1, 2, 3, 4, 5))
    held.set(ref_cnt=2)  # one more reference than listings: its release is legal
    shared.set(ref_cnt=3)
    odd.set(ref_cnt=_Id(5))  # no int exactly
    null.set(is_null=True)
    last.set(ref_cnt=1)  # its only reference, and listed
    stranger = Suspect(0)  # another pool's block at a listed id
    Suspect.reads.clear()
    blocks = [held, free, shared, stranger, null, Suspect(None), Suspect(9), odd, last]
    assert screen.first_under_listed(blocks, counts, pool_blocks) == 7
    assert Suspect.reads == [
        *("block_id", "is_null", "ref_cnt"),  # held
        "block_id",  # free: listed by none
        *("block_id", "is_null", "ref_cnt"),  # shared: 3 references, 2 listings
        "block_id",  # stranger
        *("block_id", "is_null"),  # null
        "block_id",
        "block_id",
        *("block_id", "is_null", "ref_cnt"),  # odd
    ]
    assert screen.first_under_listed([held, last], counts, pool_blocks) == 1
    shared.set(ref_cnt=2)
    assert screen.first_under_listed([shared], counts, pool_blocks) == 0
    assert screen.first_under_listed([held, free], counts, pool_blocks) == -1
    assert screen.first_under_listed([], counts, pool_blocks) == -1
    assert screen.first_under_listed([last], [0] * 8, pool_blocks) == -1


def _count_cycles(screen: ModuleType, cycles: int) -> None:
    """The counts, the suspects and the screen of releases over slotted blocks, strangers
    and raising reads."""
    pool_blocks = [KVCacheBlock(i) for i in range(16)]
    for block in pool_blocks:
        block.ref_cnt = 1
    counts = [0] * 16
    strangers = [KVCacheBlock(3), Identified(2**70), RaisingId(AttributeError("block_id"))]
    broken = RaisingId(LookupError("block_id"))
    batch = [*pool_blocks[:8], *strangers]
    for i in range(cycles):
        screen.count(batch, pool_blocks, counts, 1)
        screen.count_one(pool_blocks[i % 16], pool_blocks, counts, 1)
        screen.suspects([batch, pool_blocks[8:]], counts, pool_blocks)
        screen.first_under_listed(batch, counts, pool_blocks)
        screen.count_one(pool_blocks[i % 16], pool_blocks, counts, -1)
        screen.count(iter(batch), pool_blocks, counts, -1)
        if i % 7 == 0:
            with pytest.raises(LookupError):
                screen.count([pool_blocks[0], broken], pool_blocks, counts, 1)
            screen.count_one(pool_blocks[0], pool_blocks, counts, -1)
    assert counts == [0] * 16


@pytest.mark.parametrize("traced", [False, True], ids=["objects", "traced"])
def test_the_counts_and_suspects_leave_memory_flat(screen: ModuleType, traced: bool) -> None:
    """Nothing the counts or the suspects read or raise is kept: the refcount of the block
    class (each block holds one), the collector's objects and the traced total stay flat."""
    if traced:
        tracemalloc.start()
    try:
        _count_cycles(screen, 200)  # caches and free lists warmed up
        gc.collect()
        before = (sys.getrefcount(KVCacheBlock), len(gc.get_objects()))
        memory = tracemalloc.get_traced_memory()[0] if traced else 0
        _count_cycles(screen, 2_000)
        gc.collect()
        after = (sys.getrefcount(KVCacheBlock), len(gc.get_objects()))
        grown = tracemalloc.get_traced_memory()[0] - memory if traced else 0
    finally:
        if traced:
            tracemalloc.stop()
    assert after[0] == before[0]
    # A leak grows; what the suite's earlier tests left to be freed meanwhile (a block class
    # of theirs, its instances) only shrinks the totals, by as much as those tests left.
    assert after[1] - before[1] <= 10
    assert grown <= 32 * 1024


# -- the passing paths' screens: each the conjunction of two screens above, in one pass.


def _pool_of(block_class: type, rng: random.Random, size: int) -> list[Any]:
    """``size`` blocks of ``POOL`` with their ids, some null, some linked in a free list."""
    made = []
    for i in range(size):
        block = block_class(rng.choice([-1, 0, 0, 1, 1, 2, 3]), is_null=rng.random() < 0.05)
        block.block_id = i
        if rng.random() < 0.05:
            block.prev_free_block = block_class(0)
        made.append(block)
    return made


class IdBlock(Block):
    block_id: Any


class SlottedIdBlock:
    __slots__ = ("block_id", "is_null", "next_free_block", "pool", "prev_free_block", "ref_cnt")
    __init__ = _block_init


@pytest.fixture(params=[IdBlock, SlottedIdBlock], ids=["dict", "slots"])
def id_block_class(request: pytest.FixtureRequest) -> type:
    return request.param  # type: ignore[no-any-return]


@pytest.mark.parametrize("seed", range(60))
def test_passes_free_is_first_excess_and_first_under_listed(
    screen: ModuleType, id_block_class: type, seed: int
) -> None:
    rng = random.Random(seed)
    pool_blocks = _pool_of(id_block_class, rng, 12)
    counts = [rng.choice([0, 0, 0, 1, 2]) for _ in pool_blocks]
    strangers = [id_block_class(1, pool=rng.choice([None, OTHER])) for _ in range(2)]
    for block in strangers:
        block.block_id = rng.randrange(12)
    if rng.random() < 0.5:
        strangers = []
    blocks = [rng.choice(pool_blocks + strangers) for _ in range(rng.randint(0, 6))]
    if rng.random() < 0.3:
        blocks = list({id(block): block for block in blocks}.values())  # each once
    clean = screen.first_excess(blocks, POOL) == -1
    assert screen.passes_free(blocks, POOL, None, None) is clean
    listed = clean and screen.first_under_listed(blocks, counts, pool_blocks) < 0
    assert screen.passes_free(blocks, POOL, counts, pool_blocks) is listed


def test_passes_free_sends_the_unusual_to_the_full_guard(screen: ModuleType) -> None:
    """A ``ref_cnt`` of an int subclass, a count of no int: the full guard reads them."""
    block = IdBlock(_Count(2))
    block.block_id = 0
    assert screen.first_excess([block], POOL) == -1
    assert screen.passes_free([block], POOL, None, None) is False
    block.ref_cnt = 2
    assert screen.passes_free([block], POOL, [1], [block]) is True
    assert screen.passes_free([block], POOL, [_Count(1)], [block]) is True
    assert screen.passes_free([block], POOL, [_Count(2)], [block]) is False
    assert screen.passes_free([block], POOL, [_Count(0)], [block]) is True  # a 0 of a subclass
    assert screen.passes_free([block], POOL, ["one"], [block]) is False
    assert screen.passes_free([block], POOL, ["one"], [IdBlock(0)]) is True  # not this block
    block.block_id = -1  # no place in the counts, nor the last one
    assert screen.passes_free([block], POOL, [2], [block]) is True
    block.block_id = 1  # beyond the counts
    assert screen.passes_free([block], POOL, [2], [IdBlock(0), block]) is True
    block.block_id = 0
    assert screen.passes_free([block], None, None, None) is True  # a line without pools


def test_passes_free_reads_each_field_once_in_order(screen: ModuleType) -> None:
    pool_blocks = [Suspect(i, 2) for i in range(3)]
    Suspect.reads.clear()
    assert screen.passes_free(pool_blocks, None, [0, 1, 0], pool_blocks) is True
    assert Suspect.reads == ["is_null", "prev_free_block", "ref_cnt", "block_id"] * 3
    Suspect.reads.clear()
    pool_blocks[1].set(ref_cnt=1)  # as many references as listings: its release is refused
    assert screen.passes_free(pool_blocks, None, [0, 1, 0], pool_blocks) is False
    assert Suspect.reads == ["is_null", "prev_free_block", "ref_cnt", "block_id"] * 2


def test_passes_free_holds_and_gives_back_what_it_saw(screen: ModuleType) -> None:
    """Above the table kept on the stack (32 blocks), and with a block given twice."""
    blocks = [Block(2) for _ in range(100)]
    before = [sys.getrefcount(block) for block in blocks]
    assert screen.passes_free(blocks, POOL, None, None) is True
    assert screen.passes_free([*blocks, blocks[7]], POOL, None, None) is False
    assert screen.passes_free(blocks[:5] + blocks[:1], POOL, None, None) is False
    assert [sys.getrefcount(block) for block in blocks] == before
    with pytest.raises(LookupError):
        screen.passes_free([blocks[0], Raising(1)], POOL, None, None)
    assert sys.getrefcount(blocks[0]) == before[0]


@pytest.mark.parametrize("seed", range(60))
def test_passes_touch_is_first_negative_and_first_listed_free(
    screen: ModuleType, id_block_class: type, seed: int
) -> None:
    rng = random.Random(seed)
    pool_blocks = _pool_of(id_block_class, rng, 12)
    counts = [rng.choice([0, 0, 1, 2]) for _ in pool_blocks]
    blocks = [rng.choice(pool_blocks) for _ in range(rng.randint(0, 6))]
    clean = screen.first_negative(blocks, POOL) < 0
    assert screen.passes_touch(blocks, POOL, None, None) is clean
    listed = clean and screen.first_listed_free(blocks, counts, pool_blocks) < 0
    assert screen.passes_touch(blocks, POOL, counts, pool_blocks) is listed


def test_passes_touch_sends_the_unusual_to_the_full_guard(screen: ModuleType) -> None:
    block = IdBlock(0)
    block.block_id = 0
    assert screen.passes_touch([block], POOL, [0], [block]) is True
    assert screen.passes_touch([block], POOL, [1], [block]) is False  # listed and free
    assert screen.passes_touch([block], OTHER, None, None) is False  # another pool's
    block.block_id = _Count(0)  # an id of an int subclass is read by its value
    assert screen.passes_touch([block], POOL, [1], [block]) is False
    assert screen.passes_touch([block], POOL, [_Count(0)], [block]) is True
    block.block_id = 0
    block.ref_cnt = _Count(1)
    assert screen.first_negative([block], POOL) == -1
    assert screen.passes_touch([block], POOL, None, None) is False
    Suspect.reads.clear()
    suspect = Suspect(0, 0)
    assert screen.passes_touch([suspect], None, [0], [suspect]) is True
    assert Suspect.reads == ["is_null", "ref_cnt", "block_id"]


@pytest.mark.parametrize("seed", range(40))
def test_passes_hand_out_is_first_held_free_and_first_listed(
    screen: ModuleType, id_block_class: type, seed: int
) -> None:
    rng = random.Random(seed)
    head = id_block_class(0)
    chain = _pool_of(id_block_class, rng, 8)
    for block in chain:
        block.ref_cnt = rng.choice([0, 0, 0, 0, 1, _Count(0)])
    for left, right in zip([head, *chain], chain, strict=False):
        left.next_free_block = right
    counts = [rng.choice([0, 0, 0, 0, 1]) for _ in chain]
    n = rng.randint(0, 10)  # past the last link too
    clean = screen.first_held_free(head, n) is None
    assert screen.passes_hand_out(head, n, None, None) is clean
    listed = clean and screen.first_listed(head, n, counts, chain) is None
    assert screen.passes_hand_out(head, n, counts, chain) is listed


class _Index:
    """What a door reads of the holder index: its counts and its pool's blocks."""

    def __init__(self, counts: list[Any], blocks: list[Any]) -> None:
        self.counts = counts
        self.blocks = blocks


@pytest.mark.parametrize("seed", range(40))
def test_the_door_stops_a_block_of_its_pool_held_or_listed(
    screen: ModuleType, id_block_class: type, seed: int
) -> None:
    """A batch with a block of the door's pool that a live request lists, or that holds a
    reference (an int exactly), goes to ``stopped``, whose answer is what the queue links;
    any other batch is let in as it is, and every batch while the pool's frees run."""
    rng = random.Random(seed)
    pool_blocks = _pool_of(id_block_class, rng, 8)
    for block in pool_blocks:
        block.ref_cnt = rng.choice([0, 0, 0, 1, -1, _Count(1), "1"])
    # Another pool's blocks at the same ids, and ids past the counts or of no int exactly.
    strangers = [id_block_class(1) for _ in range(4)]
    for block, block_id in zip(strangers, [2, 8, True, 2**70], strict=True):
        block.block_id = block_id
    counts = [rng.choice([0, 0, 0, 1]) for _ in pool_blocks[:6]]  # the last two: past them
    stops: list[tuple[Any, str, Any]] = []

    def stopped(door: Any, method: str, blocks: Any) -> Any:
        stops.append((door, method, blocks))
        return blocks[:1]

    door = screen.Door("a weak reference", _Index(counts, pool_blocks), stopped)
    assert (door.pool, door.freeing) == ("a weak reference", 0)
    for _ in range(30):
        batch = [rng.choice(pool_blocks + strangers) for _ in range(rng.randrange(5))]
        made: Any = rng.choice([list, tuple])
        given = made(batch)
        own = [b for b in batch if any(b is each for each in pool_blocks[:6])]
        held = [b for b in own if counts[b.block_id] or (type(b.ref_cnt) is int and b.ref_cnt > 0)]
        got = door(rng.choice(["append", "append_n", "prepend_n"]), given)
        if held:
            assert got == given[:1]
            assert stops.pop()[::2] == (door, given)
        else:
            assert got is given
        assert stops == []
        door.freeing = 1
        assert door("append_n", given) is given
        door.freeing = 0


def test_the_door_reads_the_id_then_the_count_of_its_pools_blocks(screen: ModuleType) -> None:
    pool_blocks = [Suspect(i) for i in range(3)]
    stranger = Suspect(1)
    index = _Index([0, 0, 0], pool_blocks)
    door = screen.Door(None, index, lambda *args: pytest.fail("nothing to stop"))
    Suspect.reads.clear()
    batch = [pool_blocks[0], stranger, pool_blocks[2]]
    assert door("append_n", batch) is batch
    assert Suspect.reads == ["block_id", "ref_cnt", "block_id", "block_id", "ref_cnt"]
    Suspect.reads.clear()
    door.freeing = 2
    door("append_n", pool_blocks)
    assert Suspect.reads == []


def test_a_door_whose_block_empties_the_index_raises(screen: ModuleType) -> None:
    """Code a block runs as the door reads it (its ``ref_cnt``) may empty the index's lists:
    the count read after it raises IndexError, never reads past the list."""
    counts = [0, 0]

    class Emptying(SlottedIdBlock):
        __slots__ = ()

        @property
        def ref_cnt(self) -> int:
            counts.clear()
            return 0

        @ref_cnt.setter
        def ref_cnt(self, value: int) -> None:
            pass

    pool_blocks = [Emptying(0), Emptying(0)]
    for i, block in enumerate(pool_blocks):
        block.block_id = i
    door = screen.Door(None, _Index(counts, pool_blocks), lambda *args: args[2])
    with pytest.raises(IndexError):
        door("append_n", [pool_blocks[1]])


def test_a_door_is_neither_copied_nor_subclassed(screen: ModuleType) -> None:
    """A door is one pool's and counts its frees under way: a copy would count apart. The
    compiled door is a final type; the pure one refuses subclasses alike."""
    import copy
    import pickle

    door = screen.Door(None, _Index([], []), None)
    for refused in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="door cannot be copied or pickled"):
            refused(door)
    with pytest.raises(TypeError, match="not an acceptable base type"):
        type("Sub", (screen.Door,), {})
