"""The holder audit: what live requests list against the pool they allocate from, read
at the start of each scheduler step (its messages are ``_errors``'s).

A free that releases a reference another live request still holds leaves every count
adding up at the moment of the call; the block is then queued free while that request
lists it, and the next allocation hands it to a second request. So at the start of every
scheduler step (``KVCacheManager.new_step_starts``, which vLLM's ``Scheduler.schedule()``
calls before it counts or allocates a block), the blocks each manager lists for each live
request (``req_to_blocks``) are read against the pool:

* a listed block (null blocks aside) is never in the free list (``listed_free``);
* one request lists one block at most once in one manager (``listed_twice``), and no block
  is listed by two managers (``two_managers``);
* no block is listed more times than its ``ref_cnt`` (``under_counted``): every other
  holder (a prefix hit, copy-on-write, an offload in flight) only raises it.

The screens find these (``holder_faults``, O(listed blocks)); what follows here runs only
when one is found. ``"raise"``: :class:`~kvqueue._errors.HolderAuditError` before the step
changes anything, naming the block, its holders, its ``ref_cnt``, the pool, and the call
that last released it where the guard saw it. ``"repair"``: the block leaves the free list
and its ``ref_cnt`` is raised to its holders, as vLLM's ``touch`` would have done for each;
counted per pool (``pool_repairs``) and logged under the rate limit. A ``ref_cnt`` that is
no integer is a TypeError under either policy, before anything changes.

HiSparse's managers (vLLM 0.31+) keep pages they unpinned listed while those sit in the
free list, on purpose: their listings are not audited (``_index.unpins``). Other pools'
blocks (a CPU pool's) are not counted: the audit is of the pool the scheduler allocates
from.

The audit is the last of the checks a fault meets. A guarded free that would leave a block
fewer references than listings is refused or left out at that free (:func:`release`), by
anything but a manager of the pool; a block queued by hand while listed or held, at the free
list's entry (:func:`enter`); whatever passes both (a manager's own free whose listing stays),
at the free list's exit: ``get_new_blocks`` never hands out a block the holder index
(``_index``) says a live request lists (:func:`hand_out`), nor a prefix hit takes one
(:func:`touch_listed`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import _errors, _log, _policy, _render
from . import _index, _registry, _report, _rules
from ._own import own_attribute

__all__ = (
    "PLACES",
    "audit_holders",
    "enter",
    "hand_out",
    "read_holders",
    "release",
    "touch_listed",
)

# Per KVCacheManager, by its id: a weak reference to it (its entry goes with it), and its place:
# the guarded frees no index checked, made when it was last audited, and the steps since its
# last full audit. Read at every step, where a weak dictionary's look-up (a new weak reference
# per call) cost several times a dict's.
PLACES: dict[int, tuple[weakref.ref[Any], list[int]]] = {}
# The audited steps and the unchecked frees (``_report``'s), read and moved at every step.
_TALLY = _report.TALLY
# Holders named in a message, at most.
_SHOWN = 4
# Per pool, under repair: the double listings (kind, block id, holders) the last reads found.
# A count cannot undo a block listed twice, so the listing stands after its repair; it is
# counted and logged at the read that first finds it, not again at every read while it stands.
_standing: weakref.WeakKeyDictionary[Any, set[tuple[Any, ...]]] = weakref.WeakKeyDictionary()
_DOUBLE = frozenset(("listed_twice", "two_managers"))


def audit_holders(
    manager: Any, screen: ModuleType, policy: Callable[[Any], str], every: int = 1
) -> None:
    """The holder audit of vLLM's ``KVCacheManager`` ``manager``: nothing when every
    listed block is held; else raises or repairs as the pool's policy says.

    Every ``every`` steps (never for 0; always at a manager's first) every listing is read,
    O(listed blocks), and the holder index checked against them; at the steps between, the blocks
    released since the last audit by guarded frees that no index checked as they released
    (a pool without one, HiSparse's unpins) are looked up in the index, O(blocks freed), and
    the listings read only when one is listed and free or under-counted (where the pool has
    no index, only those blocks' listings are read, every other compared by address); not at
    all when there are none (``screen.quiet_step``, O(1)): a free that releases a reference a
    live request holds is found at that free or at the next step. An audit that raises reads
    the same frees again at the next call.

    Raises :class:`~kvqueue._errors.HolderAuditError` (``"raise"``), TypeError for a
    ``ref_cnt`` that is no integer.
    """
    if not screen.quiet_step(manager, PLACES, _TALLY, every):
        read_holders(manager, screen, policy, every)


def read_holders(
    manager: Any, screen: ModuleType, policy: Callable[[Any], str], every: int = 1
) -> None:
    """:func:`audit_holders` at a step ``screen.quiet_step`` has counted and not passed."""
    made = _TALLY[1]
    entry = PLACES.get(id(manager))
    place = entry[1] if entry is not None and entry[0]() is manager else None
    only = None
    steps = 0  # since the last full read, this one included
    if place is not None:  # a manager's first audit reads everything
        steps = place[1] + 1
        if every and steps >= every:
            steps = 0
        else:
            only = _report.recent_frees(made - place[0])
            if only is None:  # more frees than are kept: read everything
                steps = 0
    coordinator = manager.coordinator
    pool = coordinator.block_pool
    blocks = pool.blocks
    if type(blocks) is not list:
        return
    index = _index.index_of(pool)
    if only is not None and index is not None:
        # The holder index says which freed blocks may be at fault: O(blocks freed), and
        # the listings are read only for those.
        suspects = screen.suspects(only, index.counts, index.blocks)
        if not suspects:
            _keep_place(manager, made, steps)
            return
        only = [suspects]
    managers = [m for m in coordinator.single_type_managers if not _index.unpins(type(m))]
    found = screen.holder_faults(blocks, [m.req_to_blocks for m in managers], only)
    if found:
        _found(pool, managers, found, policy(pool), full=only is None)
    elif only is None:
        _not_standing(pool, [], {}, full=True)
    if index is not None and (only is None or not found):
        _rebuilt(pool, index)
    # Past the frees it read only once nothing was raised: a step retried after
    # HolderAuditError (the pool as it was) reads them again, and raises again while the
    # fault stands.
    _keep_place(manager, made, steps)


def _keep_place(manager: Any, made: int, steps: int) -> None:
    """``manager``'s place: the unchecked frees made at its last audit, and the steps since
    its last full read. A manager no weak reference can name keeps none: each of its audits
    reads everything."""
    key = id(manager)
    entry = PLACES.get(key)
    if entry is not None and entry[0]() is manager:
        entry[1][:] = (made, steps)
        return

    # The table bound here: a manager freed at the interpreter's exit still finds it.
    def forget(ref: weakref.ref[Any], places: dict[int, Any] = PLACES) -> None:
        if places.get(key, (None,))[0] is ref:
            del places[key]

    with contextlib.suppress(TypeError):
        PLACES[key] = (weakref.ref(manager, forget), [made, steps])


def _rebuilt(pool: Any, index: _index.Index) -> bool:
    """The holder index counted again; whether it was stale (a listing changed out of its
    sight: then counted and logged). The full read, not the index, says what is a fault."""
    if not index.rebuild():
        return False
    _log.repaired(
        "kvqueue's holder index was stale (#%d in this process): a listing of "
        "req_to_blocks changed out of its sight; rebuilt from every listing. %s",
        _report.count_rebuild(),
        _report.where(pool),
    )
    return True


def _found(
    pool: Any, managers: list[Any], found: list[tuple[Any, Any]], policy: str, full: bool = True
) -> None:
    for kind, block in found:
        if kind == "bad_count":
            raise _errors.audit_bad_count(_report.named(block), block.ref_cnt, _report.where(pool))
    holders = _listers(managers, {id(block) for _, block in found})
    if policy != "raise":
        found = _not_standing(pool, found, holders, full)
    for kind, _ in found:
        _report.count_finding(kind)
    if policy == "raise":
        kind, block = found[0]
        _report.count_refusal(_registry.AUDIT_HOOK, kind)
        raise _errors.audit_finding(
            _report.named(block),
            _what(kind, block, holders[id(block)]),
            _released(block),
            _report.where(pool),
        )
    queue = pool.free_block_queue
    lines = []
    for kind, block in found:
        listed = holders[id(block)]
        refs = block.ref_cnt
        what = _what(kind, block, listed)
        steps = []
        if block.prev_free_block is not None:
            queue.remove(block)
            steps.append("taken out of the free list")
        if refs < len(listed):
            block.ref_cnt = len(listed)
            steps.append(f"ref_cnt {_render.number(refs)} -> {len(listed)}")
        count = _report.count_repair(pool, kind, _registry.AUDIT_HOOK)
        done = ", ".join(steps) or "its ref_cnt covers its holders already; counted only"
        lines.append((kind, count, _report.named(block), what, done))
    _logged(
        pool,
        lines,
        "kvqueue's holder audit repaired a shared block (%s #%d on this pool): block %s %s: %s. %s",
    )


def _not_standing(
    pool: Any, found: list[tuple[Any, Any]], holders: dict[int, list[Any]], full: bool
) -> list[tuple[Any, Any]]:
    """``found`` less the double listings a read before this one found and repaired, that
    have nothing left to repair. A ``full`` read saw every listing: what it did not find no
    longer stands."""
    try:
        before = _standing.get(pool) or set()
    except TypeError:  # a pool no weak reference can name: every read counts
        return found
    now = {
        (kind, block.block_id, tuple(holders[id(block)]))
        for kind, block in found
        if kind in _DOUBLE
    }
    if now or before:
        _standing[pool] = now if full else before | now
    return [
        (kind, block)
        for kind, block in found
        if kind not in _DOUBLE
        or (kind, block.block_id, tuple(holders[id(block)])) not in before
        or block.prev_free_block is not None
        or block.ref_cnt < len(holders[id(block)])
    ]


def hand_out(
    pool: Any,
    num_blocks: int,
    index: _index.Index,
    screen: ModuleType,
    policy: Callable[[Any], str],
    call: Callable[[int], Any],
) -> Any:
    """``get_new_blocks`` when the holder index says a live request lists a block among the
    first ``num_blocks`` free ones (a release no guarded free made, or one made after this
    step's audit): ``"raise"``: HolderAuditError before anything is allocated, naming the
    block, its holders and the free that last released it; ``"repair"``: each such block
    leaves the free list, its ``ref_cnt`` raised to its listings (counted and logged), then
    vLLM's method ``call``. O(num_blocks) a walk, O(listings) to name a block's holders.

    Raises TypeError for a ``ref_cnt`` that is no integer, RuntimeError for a block the
    queue cannot unlink.
    """
    queue = pool.free_block_queue
    lines = []
    try:
        while True:
            wanted = min(num_blocks, queue.num_free_blocks)
            head = queue.fake_free_list_head
            block = screen.first_listed(head, wanted, index.counts, index.blocks)
            if block is None:
                break
            listed = index.holders(block)
            if not listed:  # stale: no table in place lists it
                if _rebuilt(pool, index):
                    continue
                break
            refs = _rules.ref_count(pool, "get_new_blocks", block)
            what = _what("listed_free", block, listed)
            if policy(pool) == "raise":
                raise _refused(pool, "get_new_blocks", block, what, _errors.listed_handed_out)
            queue.remove(block)
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise _errors.held_stuck(
                    _report.call("get_new_blocks"),
                    _report.named(block),
                    refs,
                    _report.where(pool),
                )
            steps = ["taken out of the free list"]
            if refs < len(listed):
                block.ref_cnt = len(listed)
                steps.append(f"ref_cnt {_render.number(refs)} -> {len(listed)}")
            count = _report.count_repair(pool, "listed_free", "get_new_blocks")
            lines.append((count, _report.named(block), what, ", ".join(steps)))
        return call(num_blocks)
    finally:
        _logged(
            pool,
            lines,
            "%s would have handed out a listed block (listed_free #%d on this pool): "
            "block %s %s: %s. %s",
            _report.call("get_new_blocks"),
        )


def touch_listed(
    pool: Any,
    blocks: list[Any],
    index: _index.Index,
    policy: Callable[[Any], str],
    call: Callable[[list[Any]], Any],
) -> Any:
    """``touch`` of ``blocks`` when one of them is in the free list (``ref_cnt`` 0) while a
    live request lists it (released under its holder; a prefix hit would share it):
    ``"raise"``: HolderAuditError before anything is touched, naming the block, its holders
    and the free that last released it; ``"repair"``: each such block leaves the free list,
    its ``ref_cnt`` raised to its listings (counted and logged), then vLLM's method ``call``
    adds the hit's reference. O(len(blocks)), O(listings) to name a block's holders.
    """
    queue = pool.free_block_queue
    lines = []
    try:
        for block in blocks:
            if not index.listings(block) or block.is_null or block.ref_cnt != 0:
                continue
            listed = index.holders(block)
            if not listed:  # stale: no table in place lists it
                _rebuilt(pool, index)
                continue
            what = _what("listed_free", block, listed)
            if policy(pool) == "raise":
                raise _refused(pool, "touch", block, what, _errors.listed_touched)
            # A count lowered by hand leaves the block out of the list: nothing to unlink.
            done = "taken out of the free list, " if block.prev_free_block is not None else ""
            if done:
                queue.remove(block)
            block.ref_cnt = len(listed)
            count = _report.count_repair(pool, "listed_free", "touch")
            done += f"ref_cnt 0 -> {len(listed)}"
            lines.append((count, _report.named(block), what, done))
        return call(blocks)
    finally:
        _logged(
            pool,
            lines,
            "%s would have given a listed block to a prefix hit (listed_free #%d on this "
            "pool): block %s %s: %s. %s",
            _report.call("touch"),
        )


def enter(
    pool: Any, method: str, blocks: Any, index: _index.Index, policy: Callable[[Any], str]
) -> list[Any]:
    """The blocks of ``blocks`` that ``pool``'s queue may link, when its gate (called by
    ``method``: anything but a guarded free) found one that holds a reference or that a
    live request lists: ``"raise"``: HolderAuditError, nothing queued, naming the block, its
    holders and the caller; ``"repair"``: each such block is left out (its ``ref_cnt``
    raised to its listings: nothing lost, nothing shared), counted and logged.
    O(len(blocks)) a batch, O(listings) to name a block's holders.
    """
    call = f"FreeKVCacheBlockQueue.{method}()"
    refused: list[tuple[_policy.PoolMisuse, Any, list[tuple[str, Any]]]] = []
    kept = []
    for block in blocks:
        count = index.listings(block)
        if count is None:  # not the pool's: the queue's own checks
            kept.append(block)
            continue
        listed = index.holders(block) if count else []
        if count and not listed and _rebuilt(pool, index):
            listed = index.holders(block)
        refs = getattr(block, "ref_cnt", 0)
        if listed:
            refused.append(("listed_free", block, listed))
        elif type(refs) is int and refs > 0:
            refused.append(("held_free", block, listed))
        else:
            kept.append(block)
    if not refused:
        return kept
    if policy(pool) == "raise":
        kind, block, listed = refused[0]
        _report.count_refusal(method, kind)
        raise _errors.queued_held(
            call, _report.named(block), _held(kind, block, listed), _report.where(pool)
        )
    lines = []
    for kind, block, listed in refused:
        refs = block.ref_cnt
        done = "left out of the free list"
        if type(refs) is int and refs < len(listed):
            block.ref_cnt = len(listed)
            done += f", ref_cnt {_render.number(refs)} -> {len(listed)}"
        count = _report.count_repair(pool, kind, method)
        lines.append((kind, count, _report.named(block), _held(kind, block, listed), done))
    _logged(
        pool,
        lines,
        "%s would have queued a held block free (%s #%d on this pool): block %s %s: %s. %s",
        call,
    )
    return kept


def release(
    pool: Any, method: str, blocks: list[Any], index: _index.Index, policy: Callable[[Any], str]
) -> list[Any]:
    """Of a guarded free of ``blocks``, what it may release: a release that would leave a
    block fewer references than live requests list it (a reference freed that its holder
    still holds) is the faulty call. ``"raise"``: HolderAuditError before anything is
    released, naming the block, its holders and the call; ``"repair"``: that block's excess
    releases are left out (counted as ``listed_free`` where the block would have been queued
    free, ``under_counted`` where it would have kept fewer references than holders, and
    logged): it stays with its holders. O(len(blocks)), O(listings) to name a holder.

    A manager of the pool that frees a block it still lists is let through: vLLM's mamba
    manager frees a state block and lists the null block in its place just after. Such a
    block, if it stays listed, is met by the next audit and at the free list's exit.
    """
    given: dict[int, int] = {}
    order: list[Any] = []
    for block in blocks:
        if index.listings(block):
            key = id(block)
            if key not in given:
                order.append(block)
            given[key] = given.get(key, 0) + 1
    below: list[tuple[Any, int]] = []
    for block in order:
        if block.is_null:
            continue
        refs = _rules.ref_count(pool, method, block)
        if refs - given[id(block)] < (index.listings(block) or 0):
            below.append((block, refs))
    if not below:
        return blocks
    # The manager first, in O(1): a mamba model's every state block freed comes here. What it
    # lets through is read again by the next audit, and named by it, as a free no index checked.
    if _by_manager(index):
        _report.freed(blocks, 1)
        # Listed, and queued free by vLLM's method: the free list's exit reads the index
        # again while it is.
        index.let_in(block for block, _ in below)
        return blocks
    faults: list[tuple[_policy.PoolMisuse, Any, list[tuple[str, Any]], int]] = []
    for block, refs in below:
        listed = index.holders(block)
        if not listed and _rebuilt(pool, index):
            listed = index.holders(block)
        left = refs - given[id(block)]
        if left < len(listed):
            faults.append(("listed_free" if left <= 0 else "under_counted", block, listed, refs))
    if not faults:
        return blocks
    if policy(pool) == "raise":
        kind, block, listed, refs = faults[0]
        _report.count_refusal(method, kind)
        what = f"{_who(listed)} lists (ref_cnt {_render.number(refs)})"
        raise _errors.released_listed(
            _report.call(method), _report.named(block), what, _report.where(pool)
        )
    lines = []
    # Each faulty block keeps the references its holders hold: its first releases, up to
    # what it holds beyond them, go ahead, the rest are left out.
    allowed = {id(block): max(refs - len(listed), 0) for _, block, listed, refs in faults}
    kept = []
    for block in blocks:
        releases = allowed.get(id(block))
        if releases is None:
            kept.append(block)
        elif releases > 0:
            allowed[id(block)] = releases - 1
            kept.append(block)
    for kind, block, listed, refs in faults:
        what = f"{_who(listed)} lists (ref_cnt {_render.number(refs)})"
        count = _report.count_repair(pool, kind, method)
        lines.append((kind, count, _report.named(block), what))
    _logged(
        pool,
        lines,
        "%s would have released a held reference (%s #%d on this pool): block "
        "%s, which %s: left with its holders. %s",
        _report.call(method),
    )
    return kept


def _by_manager(index: _index.Index) -> bool:
    """Whether the guarded method's caller is a manager whose ``req_to_blocks`` is one of
    ``index``'s tables. O(1)."""
    frame = _report.caller()
    owner = None if frame is None else frame.f_locals.get("self")
    table = own_attribute(owner, "req_to_blocks")
    return table is not None and type(table) is index.screen.Table and table.tally is index


def _refused(
    pool: Any, method: str, block: Any, what: str, error: Callable[..., Exception]
) -> Exception:
    """``error`` (``_errors``'s message of ``method``'s refusal) for the listed, free
    ``block``, ``what`` saying who lists it; the refusal counted. O(1)."""
    _report.count_refusal(method, "listed_free")
    return error(
        _report.call(method), _report.named(block), what, _released(block), _report.where(pool)
    )


def _logged(pool: Any, lines: list[tuple[Any, ...]], message: str, *first: Any) -> None:
    """Each repair of ``lines`` logged under the rate limit: ``message`` formatted with
    ``first``, the line's fields, then the pool and caller. O(len(lines))."""
    where = _report.where(pool)
    for fields in lines:
        _log.repaired(message, *first, *fields, where)


def _held(kind: str, block: Any, listed: list[tuple[str, Any]]) -> str:
    if kind == "listed_free":
        return f"{_who(listed)} lists (ref_cnt {_render.number(block.ref_cnt)})"
    return f"holds {_render.plural(block.ref_cnt, 'reference')}"


def _listers(managers: list[Any], wanted: set[int]) -> dict[int, list[tuple[str, Any]]]:
    """Who lists each block of ``wanted`` (by id): ``(manager class, request id)``, once
    per listing."""
    found: dict[int, list[tuple[str, Any]]] = {key: [] for key in wanted}
    for manager in managers:
        name = type(manager).__name__
        for request, blocks in manager.req_to_blocks.items():
            for block in blocks:
                if id(block) in found:
                    found[id(block)].append((name, request))
    return found


def _what(kind: str, block: Any, listed: list[tuple[str, Any]]) -> str:
    refs = _render.number(block.ref_cnt)
    who = _who(listed)
    if kind == "listed_free":
        return f"is in the free list (ref_cnt {refs}) while {who} lists it"
    if kind == "listed_twice":
        return f"is listed twice by one request in one manager ({who}; ref_cnt {refs})"
    if kind == "two_managers":
        return f"is listed by two managers ({who}; ref_cnt {refs})"
    return f"is listed {len(listed)} times ({who}) but its ref_cnt is {refs}"


def _who(listed: list[tuple[str, Any]]) -> str:
    shown = [f"request {_request(request)} ({manager})" for manager, request in listed[:_SHOWN]]
    more = len(listed) - _SHOWN
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _request(request: Any) -> str:
    return str.__repr__(request[:80]) if type(request) is str else _render.describe(request)


def _released(block: Any) -> str:
    site = _report.last_freed(block)
    if site is None:
        return ""
    return f"The last release of it no holder index checked was a free called from {site}. "
