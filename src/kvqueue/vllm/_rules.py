"""The rules the pool guard holds vLLM to, each beside its repair (its message is
``_errors``'s).

**The guarded methods.** What a screen flags is read again here in full, then refused
under ``"raise"`` (nothing changed in any pool) or repaired under ``"repair"`` (counted
per pool and logged under the rate limit); vLLM's own method does the rest:

* ``free_blocks`` / ``unpin_blocks`` (:func:`free`): a block given more times than it
  holds references, or linked in the free list already, is a double free: the excess is
  dropped, a linked one unlinked. A block of no pool (or, to ``unpin_blocks``, of another
  pool) that vLLM would queue here is refused before any count moves; another pool's
  blocks are screened under that pool's own ``"raise"`` before this pool frees anything;
  on the scheduler's pool, a release below a block's listings is ``_audit.release``'s;
* ``touch`` (:func:`touch`): a negative ``ref_cnt`` (a double free made unguarded) is
  taken as 0;
* ``get_new_blocks`` (:func:`alloc`): a held block about to be handed out is unlinked
  instead, a negative count taken as 0.

A ``ref_cnt`` that is no integer is a TypeError under either policy, before anything
changes. Only a pool's own blocks are counted: null blocks, blocks whose pool is gone
(0.34+ skips them) and blocks of no pool that vLLM would not queue keep vLLM's handling.

The holder audit, which reads what live requests list at each step, is ``_audit``'s.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import _block, _errors
from . import _report
from ._own import own_attribute

__all__ = ("FreePlan", "alloc", "free", "in_pool", "once_each", "ref_count", "touch")

# The pool guard's rules, per guarded method: what the screens sent here is read again in
# full (each block, its count, its place), then refused or repaired. ``policy`` is the
# pool guard's (``_pool_guard.PoolPolicy``): a pool's policy, asked only once a misuse is
# found.
Policy = Callable[[Any], str]
# Another pool that a free hands blocks to, with what its own guard screens them with:
# (that pool, its blocks in this call, its guard's screens, its guard's policy).
Other = tuple[Any, list[Any], ModuleType, Policy]


class FreePlan:
    """What a free of ``blocks`` on ``pool`` would do, read once (nothing changed)."""

    __slots__ = ("dropped", "given", "in_list", "kept", "linked", "others", "refs", "strays")

    def __init__(self, pool: Any, blocks: list[Any], line: Any, method: str) -> None:
        self.kept: list[Any] = []
        self.dropped: list[Any] = []
        # Held blocks found linked in the free list (a reference taken without touch()).
        self.linked: list[Any] = []
        # Other pools' blocks, by pool, in the order vLLM hands them over.
        self.others: dict[int, tuple[Any, list[Any]]] = {}
        # Blocks vLLM counts here that are not this pool's (of no pool; to unpin_blocks,
        # which routes none, of another pool too): this pool's queue would refuse them.
        self.strays: list[Any] = []
        self.given: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.in_list: set[int] = set()
        left: dict[int, int] = {}
        own = line.has_pool_field
        ref = line.pool_ref(pool)
        # The fields in the screens' order, so that a block's code runs as it did there.
        for block in blocks:
            if own:
                owner = block.pool
                if owner is not ref:
                    routed = method == "free_blocks"
                    if owner is not None and line.weak_pool:
                        # vLLM 0.34+ hands the block to the pool it refers to, and skips
                        # it if that pool is gone. Only an exact weakref is called here, as
                        # in the screens: no code of the block's runs.
                        owner = owner() if type(owner) is weakref.ref else None
                        if owner is None and routed:
                            self.kept.append(block)
                            continue
                    if owner is not None and routed:
                        self.others.setdefault(id(owner), (owner, []))[1].append(block)
                    else:
                        self.strays.append(block)
                    self.kept.append(block)
                    continue
            elif not in_pool(pool, block):
                self.kept.append(block)
                continue
            if block.is_null:
                self.kept.append(block)
                continue
            key = id(block)
            if key not in left:
                linked = block.prev_free_block is not None
                refs = ref_count(pool, method, block)
                left[key] = self.refs[key] = refs
                if linked:
                    self.in_list.add(key)
                    if refs > 0:
                        self.linked.append(block)
                    else:
                        left[key] = 0  # free already: every occurrence is one too many
            self.given[key] = self.given.get(key, 0) + 1
            (self.kept if left[key] > 0 else self.dropped).append(block)
            left[key] -= 1


def in_pool(pool: Any, block: Any) -> bool:
    """Before vLLM 0.30 a block names no pool: it is the pool's own if the pool's list holds
    it at its id. vLLM's tests free blocks they made outside any pool, which keep vLLM's
    handling (the screens, which count every block, only send such a call here)."""
    blocks = own_attribute(pool, "blocks")
    block_id = block.block_id
    return (
        type(blocks) is list
        and type(block_id) is int
        and 0 <= block_id < len(blocks)
        and blocks[block_id] is block
    )


def ref_count(pool: Any, method: str, block: Any) -> int:
    """``block.ref_cnt`` as an int; TypeError (bad input, under any policy) if it is not."""
    value = block.ref_cnt
    if type(value) is int:
        return value
    if _block.is_subtype(type(value), int):
        return int.__index__(value)
    raise _errors.ref_not_an_integer(
        _report.call(method), _report.named(block), value, _report.where(pool)
    )


def free(
    pool: Any,
    plan: FreePlan,
    line: Any,
    method: str,
    policy: Policy,
    others: list[Other],
    call: Callable[[list[Any]], Any],
    admit: Callable[[list[Any]], list[Any]] | None = None,
) -> Any:
    """``free_blocks`` / ``unpin_blocks`` whose ``plan`` the screen sent here: refused
    under ``"raise"``, repaired under ``"repair"``; ``call`` is vLLM's method, given what
    it is to free. ``others``: the pools of ``plan.others`` that kvqueue guards, each with
    its guard's screens and policy, as the pool guard found them. ``admit``: what of the
    blocks left to free may be released (it raises, or leaves some out), asked before any
    count moves."""
    if (plan.dropped or plan.linked or plan.strays) and policy(pool) == "raise":
        if plan.dropped or plan.linked:
            _raise_double_free(pool, method, plan)
        _screen_strays(pool, method, plan.strays)
    # Under their own "raise", other pools' blocks are screened before anything is freed
    # here: vLLM frees this pool's blocks first, then hands those over.
    if method == "free_blocks":
        for other in others:
            _screen_other(line, *other)
    kept = plan.kept if admit is None else admit(plan.kept)
    notes: list[_report.Note] = []
    queue = pool.free_block_queue
    for block in plan.linked:
        queue.remove(block)
        _report.repaired(pool, method, block, "held_free", notes)
    for block in plan.dropped:
        _report.repaired(pool, method, block, "double_free", notes)
    if line.counts_first and method == "free_blocks":
        kept = once_each(plan.refs, kept)
    return _report.then_log(notes, call, kept)


def _raise_double_free(pool: Any, method: str, plan: FreePlan) -> None:
    block = (plan.dropped + plan.linked)[0]
    key = id(block)
    _report.count_refusal(method, "double_free" if plan.dropped else "held_free")
    raise _errors.double_free(
        _report.call(method),
        _report.named(block),
        plan.given[key],
        plan.refs[key],
        key in plan.in_list,
        _report.where(pool),
    )


def _screen_strays(pool: Any, method: str, strays: list[Any]) -> None:
    """Raise for a stray block this call would take to 0 (vLLM would queue it here, where
    the queue refuses it after every count moved); one that keeps a reference, or whose
    count goes below 0 from 0 or less (never queued: some of vLLM's tests do so), is vLLM's."""
    for block in strays:
        if block.is_null:
            continue
        given = sum(1 for each in strays if each is block)
        refs = ref_count(pool, method, block)
        if not 1 <= refs <= given:
            continue
        owner = block.pool
        if type(owner) is weakref.ref:  # vLLM 0.34+: the pool it refers to, if alive
            owner = owner()
        whose = "no pool" if owner is None else f"another pool (BlockPool at {id(owner):#x})"
        raise _errors.stray_block(
            _report.call(method), _report.named(block), whose, refs, given, _report.where(pool)
        )


def _screen_other(
    line: Any, owner: Any, group: list[Any], screen: ModuleType, policy: Policy
) -> None:
    """Raise now what ``owner``'s guard would raise when vLLM hands it ``group``."""
    if policy(owner) != "raise":
        return
    if screen.first_excess(group, line.pool_ref(owner)) >= 0:
        plan = FreePlan(owner, group, line, "free_blocks")
        if plan.dropped or plan.linked:
            _raise_double_free(owner, "free_blocks", plan)


def once_each(refs: dict[int, int], kept: list[Any]) -> list[Any]:
    """``kept`` with each block that its occurrences take to 0 (``refs``: its ``ref_cnt``
    by id) once, at its first place, its other references released here: vLLM 0.18-0.23 would
    queue it once per occurrence."""
    times: dict[int, int] = {}
    for block in kept:
        times[id(block)] = times.get(id(block), 0) + 1
    once: list[Any] = []
    released: set[int] = set()
    for block in kept:
        key = id(block)
        count = times[key]
        if count < 2 or refs.get(key) != count:
            once.append(block)
        elif key not in released:
            released.add(key)
            block.ref_cnt -= count - 1
            once.append(block)
    return once


def touch(
    pool: Any, blocks: list[Any], first: int, line: Any, policy: Policy, call: Callable[..., Any]
) -> Any:
    """``touch`` of ``blocks``, whose ``first`` the screen found negative: refused or
    repaired; ``call`` is vLLM's method."""
    own = line.has_pool_field
    ref = line.pool_ref(pool)
    # The fields in the screen's order; _count last, as the screen's ref_cnt read.
    negative = [
        block
        for block in blocks[first:]
        if (block.pool is ref if own else in_pool(pool, block))
        and not block.is_null
        and ref_count(pool, "touch", block) < 0
    ]
    if negative and policy(pool) == "raise":
        block = negative[0]
        _report.count_refusal("touch", "negative_ref")
        raise _errors.touch_negative(
            _report.call("touch"),
            _report.named(block),
            ref_count(pool, "touch", block),
            _report.where(pool),
        )
    notes: list[_report.Note] = []
    for block in negative:
        block.ref_cnt = 0
        _report.repaired(pool, "touch", block, "negative_ref", notes)
    return _report.then_log(notes, call, blocks)


def alloc(pool: Any, num_blocks: int, policy: Policy, call: Callable[[int], Any]) -> Any:
    """``get_new_blocks`` when a block among the first ``num_blocks`` free ones has a
    ``ref_cnt`` that is not 0: one walk along the free list, O(num_blocks + repairs), or
    O(free blocks) once when one is held; ``call`` is vLLM's method."""
    queue = pool.free_block_queue
    head = queue.fake_free_list_head
    tail = queue.fake_free_list_tail
    # First every count read, nothing changed: a count that is no int is refused whole.
    bad: list[tuple[Any, int]] = []
    block = head.next_free_block
    taken = 0
    held = False
    # At most one step per free block: a cycle of held blocks cannot hold the walk. Once a
    # held block is found (a count the scheduler read was wrong), the walk goes on to the
    # end of the list, so that every count read after this call is true.
    steps = queue.num_free_blocks
    while (taken < num_blocks or held) and steps > 0 and block is not None and block is not tail:
        steps -= 1
        refs = ref_count(pool, "get_new_blocks", block)
        if refs > 0:
            bad.append((block, refs))
            held = True
        elif taken < num_blocks:
            taken += 1
            if refs < 0:
                bad.append((block, refs))
        block = block.next_free_block
    if not bad:  # code a block ran during the walk took the misuse away
        return call(num_blocks)
    if policy(pool) == "raise":
        block, refs = bad[0]
        _report.count_refusal("get_new_blocks", "held_free" if refs > 0 else "negative_ref")
        raise _errors.held_handed_out(
            _report.call("get_new_blocks"), _report.named(block), refs, _report.where(pool)
        )
    notes: list[_report.Note] = []
    for block, refs in bad:
        if refs < 0:
            block.ref_cnt = 0
            _report.repaired(pool, "get_new_blocks", block, "negative_ref", notes)
            continue
        queue.remove(block)
        if block.prev_free_block is not None or block.next_free_block is not None:
            # The queue would not take it out (its pool or links were reassigned while it
            # was linked): handed out, it would have two holders.
            _report.log_notes(notes)
            raise _errors.held_stuck(
                _report.call("get_new_blocks"), _report.named(block), refs, _report.where(pool)
            )
        _report.repaired(pool, "get_new_blocks", block, "held_free", notes)
    return _report.then_log(notes, call, num_blocks)
