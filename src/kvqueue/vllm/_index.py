"""The holder index: how many times live requests list each block of the scheduler's pool,
kept as the listings change, so that a check at a move costs what the move moves.

vLLM's managers keep, per request, the blocks it holds (``req_to_blocks``: request id ->
list of blocks). With kvqueue installed, each manager vLLM builds ends its ``__init__`` with
that table replaced by a ``Table`` of ``Listed`` lists (the screens' of the guard's twin:
``_screen_py.py``, ``_screen.pyx``), which hold the same blocks
and move the pool's :class:`Index` at every change: O(1) a block added or dropped, whatever
the cache's size. A list taken out of its table (a request freed) stops counting, and its
blocks with it. HiSparse's managers keep their own (see :func:`unpins`).
Only the pool's own blocks are counted (``pool.blocks[block.block_id] is block``): another
pool's blocks, and anything else a list holds, pass uncounted.

A listing changed out of these classes' sight (a plugin writing through ``dict`` or
``list`` itself, or a table put in a manager's place) leaves the index stale: the holder
audit's full read, and a check that finds a block listed, count every listing again
(:meth:`Index.rebuild`). A stale index is never taken for a fault: a block the index says
is listed is a fault only once a table in place lists it.
"""

from __future__ import annotations

import functools
import gc
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from . import _screen_py
from ._own import own_attribute

__all__ = (
    "INDEXES",
    "Index",
    "adopt",
    "guard_init",
    "index_of",
    "unguard_init",
    "unpins",
)


class Index:
    """Per pool: ``counts[block_id]``, how many times live requests list that block, and
    the tables that list them (read only to name a block's holders, or to count again).
    ``loose``: the blocks that looked free (``screen.looks_free``) when a listing of them
    was first counted, until :meth:`prune` finds them held or unlisted; with the free list's
    entry check, no other listed block can be in the free list, and its exit reads the
    counts only while this is not empty. ``screen``: the screens of the pool guard's twin,
    which count (``count``, ``count_one``) and make the tables (``Table``, ``Listed``)."""

    __slots__ = ("__weakref__", "blocks", "counts", "loose", "screen", "tables")

    def __init__(self, blocks: list[Any], screen: ModuleType) -> None:
        self.blocks = blocks
        self.counts = [0] * len(blocks)
        self.loose: list[Any] = []
        self.tables: list[weakref.ref[Any]] = []
        self.screen = screen

    def add(self, blocks: Iterable[Any], step: int = 1) -> None:
        """Count each of ``blocks`` ``step`` times more (-1: once less); O(len(blocks))."""
        self.screen.count(blocks, self.blocks, self.counts, step, self.loose)

    def add_one(self, block: Any, step: int = 1) -> None:
        """Count ``block`` ``step`` times more (-1: once less); O(1)."""
        self.screen.count_one(block, self.blocks, self.counts, step, self.loose)

    def let_in(self, blocks: Iterable[Any]) -> None:
        """Keep in ``loose`` ``blocks``, listed blocks let into the free list unchecked (a
        manager's own free, the entry once the guard is off), pruned once ``loose`` outgrows
        the pool (where no exit prunes it, the guard off): it holds at most what is listed
        and free. O(len(blocks)), O(pool) when pruned."""
        self.loose.extend(blocks)
        if len(self.loose) > len(self.blocks):
            self.prune()

    def prune(self) -> bool:
        """Keep in ``loose`` only the blocks still listed that still look free; whether any
        is left. O(len(loose))."""
        looks_free = self.screen.looks_free
        # In place: a count under way (a read of a block's field may run code) appends to
        # the list it was given.
        self.loose[:] = [each for each in self.loose if self.listings(each) and looks_free(each)]
        return bool(self.loose)

    def listings(self, block: Any) -> int | None:
        """How many times live requests list ``block``; None for a block not the pool's. O(1)."""
        block_id = getattr(block, "block_id", None)
        counts = self.counts
        if type(block_id) is int and 0 <= block_id < len(counts) and self.blocks[block_id] is block:
            return counts[block_id]
        return None

    def live(self) -> list[Any]:
        """The tables still their manager's ``req_to_blocks`` (one put out of place, or
        whose manager is gone, lists nothing)."""
        found = (ref() for ref in self.tables)
        return [table for table in found if table is not None and table.in_place()]

    def holders(self, block: Any) -> list[tuple[str, Any]]:
        """Who lists ``block``: ``(manager class, request id)``, once per listing;
        O(listings)."""
        return [
            (table.name, request)
            for table in self.live()
            for request, listed in dict.items(table)
            for each in listed
            if each is block
        ]

    def rebuild(self) -> bool:
        """Count every listing again (O(listings + pool blocks)); whether the counts were
        wrong. A table out of place stops counting, and its lists with it."""
        live = self.live()
        listed_type = self.screen.Listed
        for ref in self.tables:
            table = ref()
            if table is not None and all(table is not each for each in live):
                for listed in dict.values(table):
                    if type(listed) is listed_type:
                        listed.detach()
        self.tables = [weakref.ref(table) for table in live]
        counts = self.counts
        self.counts = [0] * len(self.blocks)
        self.loose.clear()
        for table in live:
            for listed in dict.values(table):
                if type(listed) is listed_type:
                    listed.tally = self
                    self.add(listed)
        return self.counts != counts


def _untracks(factory: Any) -> bool:
    """Whether ``factory`` (vLLM's table's) makes lists the cyclic collector does not track:
    kvqueue's table in its place keeps its lists out likewise."""
    if factory is None:
        return False
    made = factory()
    return type(made) is list and not gc.is_tracked(made)


# Per pool, by its id: a weak reference to it (its entry goes with it) and its index. Read
# by identity at every guarded hand-out, where a weak dictionary's look-up (a new weak
# reference per call) cost several times a dict's.
INDEXES: dict[int, tuple[weakref.ref[Any], Index]] = {}

# HiSparse's managers (vLLM 0.31+) keep pages they unpinned listed while those sit in the
# free list, on purpose: theirs are not counted. By name, so that no vLLM module is imported
# to know them.
_UNPINNING = frozenset(
    ("_HiSparseAuxiliaryManager", "HiSparseResidentManager", "HiSparseHotManager")
)
_unpins_cache: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def unpins(manager_class: type) -> bool:
    """Whether ``manager_class``'s listed pages may be free (HiSparse's unpinned pages)."""
    found = _unpins_cache.get(manager_class)
    if found is None:
        found = _unpins_cache[manager_class] = any(
            cls.__name__ in _UNPINNING for cls in manager_class.__mro__
        )
    return found


def index_of(pool: Any) -> Index | None:
    """``pool``'s index, if a manager of it was built with kvqueue installed; O(1)."""
    entry = INDEXES.get(id(pool))
    return entry[1] if entry is not None and entry[0]() is pool else None


def _keep(pool: Any, index: Index) -> bool:
    """Make ``index`` ``pool``'s; False for a pool no weak reference can name (it has none)."""
    key = id(pool)

    # The table bound here: a pool that outlives the module (freed at the interpreter's exit,
    # after its globals are cleared) still finds it.
    def forget(ref: weakref.ref[Any], indexes: dict[int, Any] = INDEXES) -> None:
        if indexes.get(key, (None,))[0] is ref:
            del indexes[key]

    try:
        INDEXES[key] = (weakref.ref(pool, forget), index)
    except TypeError:
        return False
    return True


def adopt(
    manager: Any,
    on_index: Callable[[Any, Index], None] | None = None,
    screen: ModuleType = _screen_py,
) -> None:
    """Give a just-built manager a ``Table`` of its pool's index in place of vLLM's
    ``req_to_blocks`` (a ``defaultdict``); O(what it lists). A HiSparse manager, one
    without a pool's block list, or a table of another kind keeps its own. ``on_index`` is
    handed each pool and its index when the index is made; ``screen``: the screens the index
    counts with (the pool guard's, of the twin its queue is)."""
    table = own_attribute(manager, "req_to_blocks")
    pool = own_attribute(manager, "block_pool")
    if type(table) is not defaultdict or unpins(type(manager)):
        return
    blocks = own_attribute(pool, "blocks")
    if type(blocks) is not list:
        return
    index = index_of(pool)
    if index is None or index.blocks is not blocks:
        index = Index(blocks, screen)
        if not _keep(pool, index):
            return
        if on_index is not None:
            on_index(pool, index)
    made = index.screen.Table(index, manager, _untracks(table.default_factory))
    for request, blocks in dict.items(table):
        made[request] = blocks
    manager.req_to_blocks = made
    index.tables.append(weakref.ref(made))


def guard_init(
    manager_class: type,
    on_index: Callable[[Any, Index], None] | None = None,
    screen: ModuleType = _screen_py,
) -> dict[str, Any]:
    """``manager_class.__init__`` (vLLM's ``SingleTypeKVCacheManager``'s, which every
    manager's runs) followed by :func:`adopt` (``on_index`` and ``screen`` as it says); vLLM's
    ``__init__``, by name, for :func:`unguard_init` (none for a class without its own).
    Guarding again replaces kvqueue's ``__init__`` with a new one over vLLM's, never over its
    own."""
    found = vars(manager_class).get("__init__")
    if found is None:
        return {}
    original = _made.get(found, found)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        adopt(self, on_index, screen)

    _made[__init__] = original
    manager_class.__init__ = __init__  # type: ignore[misc]
    return {"__init__": original}


def unguard_init(manager_class: type, originals: dict[str, Any]) -> None:
    """Put vLLM's ``__init__`` back if kvqueue's is still in place."""
    if vars(manager_class).get("__init__") in _made and "__init__" in originals:
        manager_class.__init__ = originals["__init__"]  # type: ignore[misc]


# The __init__ functions made here, weakly, each to the vLLM __init__ it runs.
_made: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
