"""The pool guard's screens, pure Python: the twin of ``_screen.pyx``.

Each screen reads blocks and changes nothing: it runs on every guarded call of
vLLM's ``BlockPool`` (kvqueue/vllm/_pool_guard.py), before vLLM's own method, and
answers where the first misuse is, or that there is none. A block is whatever
vLLM's pool holds: any object with ``ref_cnt``, ``is_null`` and (vLLM 0.30+)
``pool``, the pool or (0.34+) a weak reference to it.

Both twins read the same fields of the same blocks in the same order, so that
code a block runs (a property, a ``__bool__``) runs alike in both; a list that
such code changes is screened up to its length at the start, or its current
length if shorter. A ``ref_cnt`` that is not an int (or an int subclass, read
by its int value) is a misuse at that block: the guard says what it is.

The holder index's tables and lists (:class:`Table`, :class:`Listed`) are here too, each
twin's its own: vLLM reads them at every step, and the compiled twin's are C types, whose
item reads are list's and dict's own. So are the guards' passing paths (:func:`alloc_guard`,
:func:`touch_guard`, :func:`free_guard`) and the free list's :class:`Door`: vLLM calls them
several times a step, and the compiled twin's run no Python frame.
"""

from __future__ import annotations

import ctypes
import weakref
from collections import defaultdict
from collections.abc import Iterable
from itertools import islice
from typing import Any, NoReturn, SupportsIndex
from weakref import ReferenceType

from .. import _errors
from .._block import is_subtype
from ._own import own_attribute

__all__ = (
    "HOLDER_FAULTS",
    "NO_POOL",
    "OTHER_POOLS",
    "REPEATS",
    "Door",
    "Listed",
    "Table",
    "alloc_guard",
    "count",
    "count_one",
    "first_excess",
    "first_held_free",
    "first_listed",
    "first_listed_free",
    "first_negative",
    "first_under_listed",
    "free_guard",
    "holder_faults",
    "looks_free",
    "passes_free",
    "passes_hand_out",
    "passes_touch",
    "quiet_step",
    "step_guard",
    "suspects",
    "touch_guard",
)

#: What ``first_excess`` found besides no misuse, as ``-1 - flags``: blocks of other
#: pools, blocks given more than once (within the references they hold), and blocks of
#: no pool (which vLLM counts as the caller's, and its queue refuses).
OTHER_POOLS = 1
REPEATS = 2
NO_POOL = 4

_ZERO = 0

#: What :func:`holder_faults` finds, in the order it looks: a block a holder lists that is
#: in the free list; one listed twice by one holder of one manager; one listed by two
#: managers; one listed more times than its ``ref_cnt``; one whose ``ref_cnt`` is no int.
HOLDER_FAULTS = ("listed_free", "listed_twice", "two_managers", "under_counted", "bad_count")


def first_excess(blocks: list[Any], pool: object) -> int:
    """The index of the first occurrence in ``blocks`` of a block of ``pool`` that would
    take its ``ref_cnt`` below 0 if each occurrence released one reference, that releases
    a block linked in a free list, or whose ``ref_cnt`` is no int; else ``-1 - flags``
    (:data:`OTHER_POOLS`, :data:`REPEATS`, :data:`NO_POOL`); O(len(blocks)).

    Only ``pool``'s own blocks are screened: null blocks (vLLM keeps no count for them),
    another pool's blocks (vLLM hands those to their pool, whose guard screens them), blocks
    whose pool is gone (a dead weak reference: vLLM 0.34+ skips them, and they raise no
    flag) and blocks of no pool (made outside any pool, as some of vLLM's tests do) keep
    vLLM's handling. ``pool`` is what the caller's own blocks hold in their ``pool`` field
    (the pool, or from vLLM 0.34 its ``_weak_self``); None: the blocks have no ``pool``
    field (vLLM before 0.30), and every block is the caller's.
    """
    # Block ids are not unique across pools and vLLM's dataclass blocks are not
    # hashable: a block's remaining references are keyed by identity.
    left: dict[int, int] = {}
    flags = 0
    # Up to the length at the start (zip stops at the shorter): what code a block runs
    # appends is not screened, as the compiled twin does not.
    for i, block in zip(range(len(blocks)), blocks, strict=False):
        if pool is not None:
            owner = block.pool
            if owner is not pool:
                flags |= NO_POOL if owner is None or _gone(owner) else OTHER_POOLS
                continue
        if block.is_null:
            continue
        key = id(block)
        refs = left.get(key)
        if refs is None:
            # A block in the free list is free, whatever its count says.
            if block.prev_free_block is not None:
                return i
            refs = block.ref_cnt
            if type(refs) is not int:
                refs = _count(refs)
                if refs is None:
                    return i
        else:
            flags |= REPEATS
        if refs < 1:
            return i
        left[key] = refs - 1
    return -1 - flags


def first_negative(blocks: list[Any], pool: object) -> int:
    """The index of the first block of ``pool`` (null aside; ``pool`` None: any block)
    whose ``ref_cnt`` is negative or no int, or -1."""
    for i, block in zip(range(len(blocks)), blocks, strict=False):
        if (pool is None or block.pool is pool) and not block.is_null:
            refs = block.ref_cnt
            if type(refs) is not int:
                refs = _count(refs)
                if refs is None:
                    return i
            if refs < 0:
                return i
    return -1


def first_listed_free(blocks: list[Any], counts: list[int], pool_blocks: list[Any]) -> int:
    """The index of the first block whose ``ref_cnt`` is 0 (in the free list, as vLLM's
    ``touch`` reads it) while a live request lists it (``counts[block_id]`` not 0, the holder
    index's, and the block is ``pool_blocks[block_id]``), null blocks aside, or -1;
    O(len(blocks))."""
    for i, block in zip(range(len(blocks)), blocks, strict=False):
        refs = _count(block.ref_cnt)
        if refs is None or refs != 0:
            continue
        if _listed(block, counts, pool_blocks) and not block.is_null:
            return i
    return -1


def first_held_free(head: Any, n: int) -> Any:
    """The first of the ``n`` blocks after ``head`` (a free list's head sentinel)
    whose ``ref_cnt`` is not 0 (or no int), or None; O(n). A link that is None ends
    the walk."""
    return _first_unfit(head, n, None, None)


def _first_unfit(head: Any, n: int, counts: list[int] | None, pool_blocks: Any) -> Any:
    """The first of the ``n`` blocks after ``head`` that is held (a ``ref_cnt`` not 0, or
    no int) or, ``counts`` given, listed; None if none is. Fields are read in the order
    ``next_free_block``, ``ref_cnt``, ``block_id`` (``counts`` given), block by block."""
    block = head
    for _ in range(n):
        block = block.next_free_block
        # A count assigned above the list's length (vLLM's tests fake a full cache so)
        # ends the walk at the tail: what vLLM then does is vLLM's.
        if block is None:
            return None
        refs = block.ref_cnt
        # A free block's count is the interpreter's one 0 object, the identity test the
        # quick way past it; any other value (an int, a 0 of a subclass or no int) is read.
        if refs is not _ZERO and _count(refs) != 0:
            return block
        if counts is not None and _listed_as(block, block.block_id, counts, pool_blocks):
            return block
    return None


def first_listed(head: Any, n: int, counts: list[int], pool_blocks: list[Any]) -> Any:
    """The first of the ``n`` blocks after ``head`` (a free list's head sentinel) that a
    live request lists (``counts[block_id]`` not 0, the holder index's, and the block is
    ``pool_blocks[block_id]``), or None; O(n). A link that is None ends the walk."""
    block = head
    for _ in range(n):
        block = block.next_free_block
        if block is None:
            return None
        if _listed(block, counts, pool_blocks):
            return block
    return None


def passes_free(
    blocks: list[Any], pool: object, counts: list[int] | None, pool_blocks: list[Any]
) -> bool:
    """Whether :func:`first_excess` finds nothing in ``blocks``, and no flag, and (``counts``
    given: the holder index's, with ``pool_blocks``) :func:`first_under_listed` finds nothing;
    in one pass, the free guard's passing path. False too at a ``ref_cnt`` that is no int
    exactly, which the full guard reads. O(len(blocks)).

    Fields are read in the order ``pool``, ``is_null``, ``prev_free_block``, ``ref_cnt``,
    ``block_id`` (``counts`` given; a read that raises AttributeError reads as none), up to
    the first block that fails; a count of no int fails too."""
    # By identity, each block held while the pass runs: one given twice fails.
    seen: dict[int, Any] = {}
    for block in islice(blocks, len(blocks)):
        if pool is not None and block.pool is not pool:
            return False
        if block.is_null:
            continue
        key = id(block)
        if key in seen or block.prev_free_block is not None:
            return False
        seen[key] = block
        refs = block.ref_cnt
        if type(refs) is not int or refs < 1:
            return False
        if counts is None:
            continue
        # _own_listings inlined: a free passes it for each block. A count of 0 is the
        # interpreter's one 0 object (the index adds and takes exact ints), the quick way past;
        # a count below the references passes whoever's block it is, the pool's not read.
        try:
            block_id = block.block_id
        except AttributeError:  # read as none, as _own_listings does
            continue
        if type(block_id) is not int or block_id < 0:
            continue
        try:
            listed: int | None = counts[block_id]
        except IndexError:
            continue
        if listed is _ZERO or (type(listed) is int and listed < refs):
            continue
        if type(listed) is not int:
            listed = _count(listed)  # None: a count of no int, which the pool's block fails
            if listed is not None and listed < refs:
                continue
        if block_id < len(pool_blocks) and pool_blocks[block_id] is block:
            return False
    return True


def passes_touch(
    blocks: list[Any], pool: object, counts: list[int] | None, pool_blocks: list[Any]
) -> bool:
    """Whether :func:`first_negative` finds nothing in ``blocks`` and (``counts`` given: the
    holder index's, with ``pool_blocks``) :func:`first_listed_free` finds nothing; in one
    pass, the touch guard's passing path. False too at a block of no pool or another
    (``pool`` not None), or a ``ref_cnt`` that is no int exactly, which the full guard
    reads. O(len(blocks)).

    Fields are read in the order ``pool``, ``is_null``, ``ref_cnt``, and for a ``ref_cnt``
    of 0 ``block_id`` (``counts`` given), up to the first block that fails."""
    for block in islice(blocks, len(blocks)):
        if pool is not None and block.pool is not pool:
            return False
        if block.is_null:
            continue
        refs = block.ref_cnt
        if type(refs) is not int or refs < 0:
            return False
        if (
            refs == 0
            and counts is not None
            and _listed_as(block, block.block_id, counts, pool_blocks)
        ):
            return False
    return True


def passes_hand_out(head: Any, n: int, counts: list[int] | None, pool_blocks: list[Any]) -> bool:
    """Whether :func:`first_held_free` finds none of the ``n`` blocks after ``head`` and
    (``counts`` given: the holder index's, with ``pool_blocks``) :func:`first_listed` finds
    none; in one walk, the allocation guard's passing path. O(n).

    Fields are read in the order ``next_free_block``, ``ref_cnt``, ``block_id`` (``counts``
    given), block by block, up to the first that fails; a link that is None ends the walk."""
    return _first_unfit(head, n, counts, pool_blocks) is None


class Door:
    """The free list's entry of one pool with a holder index (its queue's ``gate``): a
    block that holds a reference, or that a live request lists (``index``'s counts), is
    not let in, but while ``freeing`` (the pool's guarded frees under way, which checked
    their blocks). ``pool``: a weak reference to the pool; ``stopped(door, method, blocks)``
    decides a batch the door stops and returns what is linked. O(len(blocks)) a batch.

    Fields are read as ``getattr(block, name, default)``: ``block_id`` (None), and for a
    block of the pool (``index.blocks[block_id]``, its ``block_id`` an int exactly within
    both of the index's lists) ``ref_cnt`` (0), block by block, up to the first that is
    stopped."""

    __slots__ = ("freeing", "index", "pool", "stopped")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # The compiled twin is a final type; keep the twins interchangeable.
        raise TypeError("Door is not an acceptable base type")

    def __init__(self, pool: Any, index: Any, stopped: Any) -> None:
        self.pool = pool
        self.index = index
        self.stopped = stopped
        self.freeing = 0

    def __reduce_ex__(self, protocol: object, /) -> NoReturn:
        """Refuse: copy, deepcopy and pickle raise TypeError."""
        raise TypeError(_errors.DOOR_UNCOPYABLE)

    def __call__(self, method: str, blocks: Any) -> Any:
        if self.freeing:
            return blocks
        index = self.index
        counts, pool_blocks = index.counts, index.blocks
        for block in blocks:
            block_id = getattr(block, "block_id", None)
            if (
                type(block_id) is not int
                or not 0 <= block_id < len(counts)
                or block_id >= len(pool_blocks)
                or pool_blocks[block_id] is not block
            ):
                continue  # not the pool's: the queue's own checks
            refs = getattr(block, "ref_cnt", 0)
            if counts[block_id] or (type(refs) is int and refs > 0):
                return self.stopped(self, method, blocks)
        return blocks


# Not a value a caller passes: a call without the first argument.
_MISSING: Any = object()
# A pool's counts and blocks where it has no holder index: its passing paths check no listing.
_NO_INDEX: Any = (None, None)


def _exit_index(pool: Any, queue: Any, indexes: dict[int, Any]) -> Any:
    """What a block leaving ``pool``'s free list is checked against: the holder index's counts
    and blocks, or ``_NO_INDEX`` when no listed block can be in the list. Behind a door (its
    queue's :class:`Door` of ``pool``, which holds the index; its weak reference, a
    ``weakref.ref`` exactly, read as the pool's, not called), the entry lets no listed block
    in, and a block listed while it looked free is kept in the index's ``loose``: the counts
    are read only while one of those is still listed and free (``Index.prune``). Else the
    index in ``indexes`` (``id(pool)`` -> (weak reference, index)), whose counts are read
    whatever the list holds."""
    door: Any = getattr(queue, "gate", None)
    if type(door) is Door:
        ref = door.pool
        if type(ref) is ReferenceType and ref() is pool:
            held = door.index
            if held.loose and held.prune():
                return held.counts, held.blocks
            return _NO_INDEX
    entry = indexes.get(id(pool))
    held = entry[1] if entry is not None and entry[0]() is pool else None
    return _NO_INDEX if held is None else (held.counts, held.blocks)


def alloc_guard(original: Any, slow: Any, indexes: dict[int, Any]) -> Any:
    """``get_new_blocks`` guarded on the path vLLM takes: a count given by position alone, an
    int exactly, whose blocks :func:`passes_hand_out` passes (against the pool's holder index:
    its queue's :class:`Door`'s, else the one in ``indexes``: ``id(pool)`` -> (weak
    reference, index)), goes to vLLM's ``original`` as it is; every other call goes to
    ``slow`` (the guard in full, which screens again and says what it finds). O(blocks asked
    for)."""

    def get_new_blocks(self: Any, num_blocks: Any = _MISSING, /, *args: Any, **kwargs: Any) -> Any:
        if type(num_blocks) is not int or args or kwargs:
            if num_blocks is _MISSING:
                return slow(self, *args, **kwargs)
            return slow(self, num_blocks, *args, **kwargs)
        queue = self.free_block_queue
        # Asked for more than is free, or for none: vLLM's own answer, from vLLM.
        if 0 < num_blocks <= queue.num_free_blocks:
            # The free list's exit: a block a live request lists is never handed out.
            counts, blocks = _exit_index(self, queue, indexes)
            if _first_unfit(queue.fake_free_list_head, num_blocks, counts, blocks) is not None:
                return slow(self, num_blocks)
        return original(self, num_blocks)

    return get_new_blocks


def touch_guard(original: Any, slow: Any, indexes: dict[int, Any], own: bool, weak: bool) -> Any:
    """``touch`` guarded on the path vLLM takes: blocks given by position alone (iterated
    once, into a list, which is what vLLM is given) that :func:`passes_touch` passes (against
    the pool's holder index, found as :func:`alloc_guard` finds it) go to vLLM's ``original``;
    every other call goes to ``slow`` (the guard in full) with that list. ``own``: the blocks
    name their pool (vLLM 0.30+); ``weak``: by the pool's ``_weak_self`` (0.34+).
    O(len(blocks))."""

    def touch(self: Any, blocks: Any = _MISSING, /, *args: Any, **kwargs: Any) -> Any:
        if blocks is _MISSING:
            return slow(self, *args, **kwargs)
        if args or kwargs:
            return slow(self, blocks, *args, **kwargs)
        blocks = list(blocks)
        # A prefix hit takes a block out of the free list's middle: not one a live request
        # lists. The queue read as vLLM's touch may never read it (only for a free block).
        queue = getattr(self, "free_block_queue", None)
        counts, pool_blocks = _exit_index(self, queue, indexes)
        pool = self._weak_self if weak else self if own else None
        if passes_touch(blocks, pool, counts, pool_blocks):
            return original(self, blocks)
        return slow(self, blocks)

    return touch


def free_guard(original: Any, slow: Any, freed: Any, own: bool, weak: bool, releases: bool) -> Any:
    """``free_blocks`` or ``unpin_blocks`` guarded on the path vLLM takes: blocks given by
    position alone (iterated once, into a list, which is what vLLM is given) to a pool whose
    queue's ``gate`` is a :class:`Door` (the free list's entry, with the holder index), that
    :func:`passes_free` passes (against that index when ``releases``): the free is kept
    (``freed(blocks, depth)``) unless the index checked it, and vLLM's ``original`` runs with
    the door open to it. Every other call goes to ``slow`` (the guard in full) with that list.
    ``own``, ``weak``: as :func:`touch_guard`'s. O(len(blocks))."""

    def free_blocks(self: Any, blocks: Any = _MISSING, /, *args: Any, **kwargs: Any) -> Any:
        if blocks is _MISSING:
            return slow(self, *args, **kwargs)
        if args or kwargs:
            return slow(self, blocks, *args, **kwargs)
        blocks = list(blocks)
        door: Any = getattr(self.free_block_queue, "gate", None)
        if type(door) is not Door:
            return slow(self, blocks)
        held = door.index if releases else None
        counts, pool_blocks = _NO_INDEX if held is None else (held.counts, held.blocks)
        pool = self._weak_self if weak else self if own else None
        if not passes_free(blocks, pool, counts, pool_blocks):
            return slow(self, blocks)
        if not releases:  # a release the index checked is named as it is made
            freed(blocks, 2)  # this frame, then the caller's
        door.freeing += 1
        try:
            return original(self, blocks)
        finally:
            door.freeing -= 1

    return free_blocks


def quiet_step(manager: Any, places: dict[int, Any], tally: list[int], every: int) -> bool:
    """Count a step of ``manager``'s holder audit (``tally[0]``), and whether nothing is to be
    read at it: ``manager``'s place in ``places`` (``id`` -> (a weak reference to it, [the
    guarded frees no index checked made by its last audit, the steps since its last full
    read])) shows no full read due (``every`` 0, or more than those steps) and no such free
    made since (``tally[1]``, their count); then the step is counted in that place. False
    for a manager without one. O(1): this runs at every step."""
    tally[0] += 1
    entry = places.get(id(manager))
    if entry is None:
        return False
    ref, place = entry
    if type(ref) is not ReferenceType or ref() is not manager:
        return False
    steps = place[1] + 1
    if (every and steps >= every) or place[0] != tally[1]:
        return False
    place[1] = steps
    return True


def step_guard(
    original: Any, read: Any, guard: Any, policy: Any, places: dict[int, Any], tally: list[int]
) -> Any:
    """``new_step_starts`` guarded: the holder audit, then vLLM's ``original``. Unless
    ``guard`` is retired, a step :func:`quiet_step` does not pass (against ``places`` and
    ``tally``, ``policy.every``'s cadence) is read: ``read(manager, every)``. O(1) a quiet
    step."""

    def new_step_starts(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not guard.retired:
            every = policy.every
            if not quiet_step(self, places, tally, every):
                read(self, every)
        # vLLM calls it with no argument: a call that passes none is the interpreter's
        # quick one (no tuple or dict built for them).
        if args or kwargs:
            return original(self, *args, **kwargs)
        return original(self)

    return new_step_starts


def _listed(block: Any, counts: list[int], pool_blocks: list[Any]) -> bool:
    """Whether ``block`` is ``pool_blocks[block_id]`` and ``counts[block_id]`` (the holder
    index's) is not 0."""
    return _listed_as(block, block.block_id, counts, pool_blocks)


def _listed_as(block: Any, block_id: Any, counts: list[int], pool_blocks: list[Any]) -> bool:
    """:func:`_listed` of ``block``, its ``block_id`` read as ``block_id``."""
    # The quick way past a block no request lists: an exact int within counts, whose count
    # is the interpreter's one 0 object.
    if type(block_id) is int and 0 <= block_id < len(counts) and counts[block_id] is _ZERO:
        return False
    block_id = _count(block_id)
    if block_id is None or block_id < 0:
        return False
    if block_id >= len(counts) or block_id >= len(pool_blocks):
        return False
    listed = _count(counts[block_id])
    return listed is not None and listed != 0 and pool_blocks[block_id] is block


def count(
    blocks: Any, pool_blocks: list[Any], counts: list[int], step: int, loose: Any = None
) -> None:
    """Add ``step`` to ``counts[block_id]`` (the holder index's) for each of ``blocks`` (any
    iterable, iterated once) that is ``pool_blocks[block_id]``, its ``block_id`` an int
    (exactly) within both lists; anything else passes uncounted. With ``loose`` (a list) and
    a positive ``step``, each block counted from 0 that :func:`looks_free` is appended to it.
    O(len(blocks)).

    A ``block_id`` read that raises AttributeError reads as none; any other exception raises
    through, the blocks before it counted."""
    up = loose is not None and step > 0
    for block in blocks:
        block_id = getattr(block, "block_id", None)
        if (
            type(block_id) is int
            and 0 <= block_id < len(counts)
            and block_id < len(pool_blocks)
            and pool_blocks[block_id] is block
        ):
            before = counts[block_id]
            counts[block_id] += step
            # From 0: the interpreter's one 0 object, the quick way (no call per block listed).
            if (
                up
                and (before is _ZERO or (type(before) is not int and _count(before) == 0))
                and looks_free(block)
            ):
                loose.append(block)


def count_one(
    block: Any, pool_blocks: list[Any], counts: list[int], step: int, loose: Any = None
) -> None:
    """:func:`count` of the one block ``block``; O(1)."""
    count((block,), pool_blocks, counts, step, loose)


def looks_free(block: Any) -> bool:
    """Whether ``block`` may be in a free list: not null, and it holds no reference (its
    ``ref_cnt`` no int above 0, exactly) or is linked (its ``prev_free_block`` not None).
    Each field read as ``getattr(block, name, None)``, in that order; O(1)."""
    if getattr(block, "is_null", None) is True:
        return False
    refs = getattr(block, "ref_cnt", None)
    if type(refs) is not int or refs < 1:
        return True
    return getattr(block, "prev_free_block", None) is not None


def first_under_listed(blocks: list[Any], counts: list[int], pool_blocks: list[Any]) -> int:
    """The index of the first block that a live request lists (``counts[block_id]`` not 0,
    the holder index's, the block ``pool_blocks[block_id]``, its ``block_id`` an int
    exactly), not null, whose ``ref_cnt`` is at most its listings (one release would leave
    it fewer references than listings) or no int, exactly; else -1. O(len(blocks)).

    Fields are read in the order ``block_id``, ``is_null``, ``ref_cnt``; a ``block_id`` read
    that raises AttributeError reads as none."""
    for i, block in zip(range(len(blocks)), blocks, strict=False):
        listed = _own_listings(block, counts, pool_blocks)
        if not listed or block.is_null:
            continue
        refs = block.ref_cnt
        if type(refs) is not int or refs <= listed:
            return i
    return -1


def suspects(freed: list[list[Any]], counts: list[int], pool_blocks: list[Any]) -> list[Any]:
    """Of the blocks of the batches ``freed``, in order, those a live request lists
    (``counts[block_id]`` not 0, the holder index's, the block ``pool_blocks[block_id]``,
    its ``block_id`` an int exactly) that are not null and are in a free list or hold fewer
    references than listings (or a ``ref_cnt`` that is no int, exactly); O(blocks freed).

    Fields are read in the order ``block_id``, ``is_null``, ``ref_cnt``,
    ``prev_free_block``; a ``block_id`` read that raises AttributeError reads as none."""
    found = []
    for batch in freed:
        for block in batch:
            listed = _own_listings(block, counts, pool_blocks)
            if not listed or block.is_null:
                continue
            refs = block.ref_cnt
            if block.prev_free_block is not None or type(refs) is not int or refs < listed:
                found.append(block)
    return found


def _own_listings(block: Any, counts: list[Any], pool_blocks: list[Any]) -> Any:
    """``counts[block_id]`` for a block that is ``pool_blocks[block_id]``, its ``block_id`` an
    int exactly within both lists; else 0. A ``block_id`` read that raises AttributeError
    reads as none."""
    block_id = getattr(block, "block_id", None)
    if type(block_id) is not int or not 0 <= block_id < len(counts):
        return 0
    # The count first: most blocks a check reads are listed by none.
    listed = counts[block_id]
    if _count(listed) == 0 or block_id >= len(pool_blocks) or pool_blocks[block_id] is not block:
        return 0
    return listed


def _gone(owner: object) -> bool:
    """Whether ``owner`` is a weak reference whose pool is gone; calls no code of its own
    (only an exact ``weakref.ref`` is called)."""
    return type(owner) is ReferenceType and owner() is None


def _count(value: object) -> int | None:
    """``value`` as the int a ``ref_cnt`` is, or None; runs no code of ``value``'s."""
    if type(value) is int:
        return value
    if is_subtype(type(value), int):
        return int.__index__(value)  # type: ignore[arg-type]
    return None


def holder_faults(
    pool_blocks: list[Any], tables: list[Any], only: list[list[Any]] | None = None
) -> list[tuple[str, Any]]:
    """What the holders of ``pool_blocks`` list against what the blocks say: a list of
    ``(kind, block)`` (kinds: :data:`HOLDER_FAULTS`), each block once, at its first fault
    in listing order; empty when every holder's blocks are held. O(listed blocks).

    ``tables``: one mapping per manager (vLLM's ``req_to_blocks``), holder -> its blocks.
    Only ``pool_blocks``'s own blocks are counted (``pool_blocks[block.block_id] is
    block``); null blocks are skipped. A block's count is checked at each listing against
    the listings so far, so its first fault is found where it shows. ``only``: lists of
    blocks (the batches freed since the last audit); a listing of any other object is
    passed over unread, by identity alone.
    """
    wanted = None if only is None else {id(block) for batch in only for block in batch}
    # block_id -> [block, listings, manager, holder stamp, reported]
    seen: dict[int, list[Any]] = {}
    found: list[tuple[str, Any]] = []
    stamp = 0
    size = len(pool_blocks)
    for group, table in enumerate(tables):
        for blocks in table.values():
            stamp += 1
            if type(blocks) is not list:
                blocks = list(blocks)
            for _, block in zip(range(len(blocks)), blocks, strict=False):
                if wanted is not None and id(block) not in wanted:
                    continue
                if block.is_null:
                    continue
                block_id = _count(block.block_id)
                if block_id is None or not 0 <= block_id < min(size, len(pool_blocks)):
                    continue
                if pool_blocks[block_id] is not block:
                    continue
                entry = seen.get(block_id)
                kind: str | None = None
                if entry is None or entry[0] is not block:
                    entry = seen[block_id] = [block, 0, group, stamp, False]
                    if block.prev_free_block is not None:
                        kind = "listed_free"
                elif entry[3] == stamp:
                    kind = "listed_twice"
                elif entry[2] != group:
                    kind = "two_managers"
                entry[3] = stamp
                entry[1] += 1
                if kind is None and not entry[4]:
                    refs = _count(block.ref_cnt)
                    if refs is None:
                        kind = "bad_count"
                    elif entry[1] > refs:
                        kind = "under_counted"
                if kind is not None and not entry[4]:
                    entry[4] = True
                    found.append((kind, block))
    return found


class Listed(list):  # type: ignore[type-arg]
    """A request's blocks in one manager's table: a list that moves its index as it changes
    (O(1) a block), until it leaves its table (``tally`` None: a list like any other)."""

    __slots__ = ("tally",)

    def __new__(cls, *args: Any, **kwargs: Any) -> Listed:
        # Made without __init__ (by __new__ alone), a list like any other, as the compiled
        # twin's, whose fields start as None.
        made = super().__new__(cls)
        made.tally = None
        return made

    def __init__(self, index: Any, blocks: Iterable[Any] = ()) -> None:
        super().__init__(blocks)
        self.tally = index
        if index is not None:
            count(self, index.blocks, index.counts, 1, index.loose)

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        # A copy (copy, deepcopy, pickle) is in no table: a plain list.
        return (list, (list(self),))

    def detach(self) -> None:
        """Out of its table: its blocks are listed no more, and it counts nothing again."""
        tally = self.tally
        if tally is not None:
            count(self, tally.blocks, tally.counts, -1)
            self.tally = None

    def append(self, block: Any) -> None:
        list.append(self, block)
        tally = self.tally
        if tally is not None:
            count_one(block, tally.blocks, tally.counts, 1, tally.loose)

    def extend(self, blocks: Iterable[Any]) -> None:
        blocks = list(blocks)
        list.extend(self, blocks)
        tally = self.tally
        if tally is not None:
            count(blocks, tally.blocks, tally.counts, 1, tally.loose)

    def __iadd__(self, blocks: Iterable[Any]) -> Listed:  # type: ignore[misc]
        self.extend(blocks)
        return self

    def __imul__(self, times: SupportsIndex) -> Listed:
        before = list(self)
        list.__imul__(self, times)
        if self.tally is not None:
            self.tally.add(before, -1)
            self.tally.add(self)
        return self

    def insert(self, where: SupportsIndex, block: Any) -> None:
        list.insert(self, where, block)
        if self.tally is not None:
            self.tally.add_one(block)

    def pop(self, where: SupportsIndex = -1) -> Any:
        block = list.pop(self, where)
        if self.tally is not None:
            self.tally.add_one(block, -1)
        return block

    def remove(self, block: Any) -> None:
        # The element list.remove would take (the first equal one), by its place.
        self.pop(list.index(self, block))

    def clear(self) -> None:
        before = list(self)
        list.clear(self)
        if self.tally is not None:
            self.tally.add(before, -1)

    def __setitem__(self, where: Any, value: Any) -> None:
        before = list.__getitem__(self, where)
        if type(where) is slice:
            value = list(value)
            list.__setitem__(self, where, value)
            if self.tally is not None:
                self.tally.add(before, -1)
                self.tally.add(value)
        else:
            list.__setitem__(self, where, value)
            if self.tally is not None:
                self.tally.add_one(before, -1)
                self.tally.add_one(value)

    def __delitem__(self, where: Any) -> None:
        before = list.__getitem__(self, where)
        list.__delitem__(self, where)
        if self.tally is not None:
            self.tally.add(before if type(where) is slice else [before], -1)


_ABSENT: Any = object()


class Table(dict):  # type: ignore[type-arg]
    """One manager's ``req_to_blocks``: a dict whose lists (made as a request is first
    looked up, as vLLM's ``defaultdict`` makes them) are :class:`Listed` of one index; a
    list taken out is detached. A list put in by hand is kept as it is, the very object
    (vLLM's tests hold it), and uncounted: the full read still reads it. ``untracked``: its
    lists are kept out of the cyclic collector's sight, as vLLM's (0.34+) are."""

    __slots__ = ("__weakref__", "manager", "name", "tally", "untracked")
    manager: Any  # a weak reference to the manager (None: made without __init__)
    name: str | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Table:
        made = super().__new__(cls)
        made.manager = made.name = made.tally = None
        made.untracked = False
        return made

    def __init__(self, index: Any, manager: Any, untracked: bool) -> None:
        super().__init__()
        self.tally = index
        self.manager = weakref.ref(manager)
        self.name = type(manager).__name__
        self.untracked = untracked and _untrack is not None

    def __missing__(self, request: Any) -> Listed:
        listed = Listed(self.tally)
        if self.untracked:
            _untrack(listed)
        dict.__setitem__(self, request, listed)
        return listed

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        # A copy (copy, deepcopy, pickle) is no manager's table: a plain defaultdict of
        # plain lists, as vLLM's own would copy.
        return (_plain, (list(dict.items(self)),))

    def copy(self) -> defaultdict[Any, Any]:
        return _plain(list(dict.items(self)))

    def __copy__(self) -> defaultdict[Any, Any]:
        return self.copy()

    def in_place(self) -> bool:
        manager = self.manager()
        return manager is not None and own_attribute(manager, "req_to_blocks") is self

    def __setitem__(self, request: Any, blocks: Any) -> None:
        if type(blocks) is Listed and blocks.tally is None:  # detached: counted again
            blocks.tally = self.tally
            self.tally.add(blocks)
        old = dict.get(self, request)
        dict.__setitem__(self, request, blocks)
        if old is not None and old is not blocks:
            _detach(old)

    def __delitem__(self, request: Any) -> None:
        old = dict.pop(self, request)
        _detach(old)

    def pop(self, request: Any, *default: Any) -> Any:
        # One look-up where the request is listed: every finished request's removal.
        old = dict.pop(self, request, _ABSENT)
        if old is _ABSENT:
            return dict.pop(self, request, *default)
        if type(old) is Listed:
            old.detach()
        return old

    def popitem(self) -> tuple[Any, Any]:
        request, old = dict.popitem(self)
        _detach(old)
        return request, old

    def clear(self) -> None:
        old = list(self.values())
        dict.clear(self)
        for each in old:
            _detach(each)

    def setdefault(self, request: Any, default: Any = None) -> Any:
        if request not in self:
            self[request] = [] if default is None else default
        return dict.__getitem__(self, request)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for request, blocks in dict(*args, **kwargs).items():
            self[request] = blocks

    def __ior__(self, other: Any) -> Table:  # type: ignore[misc]
        self.update(other)
        return self


# vLLM (0.34+) keeps its tables' lists out of the cyclic collector's sight, so that a
# collection does not visit every block of every request; a list kvqueue makes in their
# place is kept out likewise. A Listed refers to blocks and to its index, neither of which
# refers back to it: it can be in no cycle.
# Only CPython's C API can untrack (PyPy's ctypes has no pythonapi): elsewhere a list kvqueue
# makes stays tracked, which costs a collection time, never a block.
_untrack: Any = getattr(getattr(ctypes, "pythonapi", None), "PyObject_GC_UnTrack", None)
if _untrack is not None:
    _untrack.argtypes = (ctypes.py_object,)
    _untrack.restype = None


def _plain(items: list[tuple[Any, Any]]) -> defaultdict[Any, Any]:
    return defaultdict(list, ((request, list(blocks)) for request, blocks in items))


def _detach(blocks: Any) -> None:
    if type(blocks) is Listed:
        blocks.detach()
