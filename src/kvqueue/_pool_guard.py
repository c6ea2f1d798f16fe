"""The pool guard: vLLM's ``BlockPool`` methods that move reference counts, checked first.

A double free that never reaches a queue call (vLLM issue 42571: one block twice in
one ``free_blocks()`` call takes its ``ref_cnt`` 1, 0, -1 and links it once) is seen
here, where the count moves. Each guarded method screens its arguments (the twins
``_screen.pyx`` / ``_screen_py.py``: read only, O(blocks)), then calls vLLM's own
method, so the guard follows whatever the installed vLLM does:

* ``free_blocks`` / ``unpin_blocks``: a block given more times than it holds
  references (its ``ref_cnt`` would go below 0), or linked in the free list already,
  is a double free;
* ``touch``: a block whose ``ref_cnt`` is negative already (a double free that
  happened unguarded) would come back to 0 while still linked as free;
* ``get_new_blocks``: a block about to be handed out whose ``ref_cnt`` is not 0.

The pool's misuse policy is its queue's (``on_misuse``), else the policy given to
``install()``. ``"raise"``: ValueError naming the block, the pool and the call, before
anything changes in any pool. ``"repair"``: the excess occurrences are dropped (a
negative count is taken as 0, a held block is unlinked rather than handed out), the
rest is done by vLLM's own method, and the repair is counted per pool and logged on
the queue's logger under the queue's rate limit. A ``ref_cnt`` that is not an integer
is a TypeError under either policy, before anything changes. Only a pool's own blocks
are counted here: null blocks, another pool's blocks (``free_blocks`` routes them to
their pool, whose guard repairs them; under that pool's ``"raise"`` they are screened
up front), blocks whose pool is gone (0.34+ skips them) and blocks of no pool keep
vLLM's handling.

Each guard follows its vLLM line (``kvqueue._vllm_lines.Line``): the parameters of the
method it wraps (0.34's ``free_blocks`` takes ``evict_first`` too, passed on as given),
whether blocks name their pool (0.30+) and how (0.34+: by a weak reference, the pool's
``_weak_self``), and whether ``free_blocks``
decrements every occurrence before it queues any (0.23, which would queue a block listed
twice twice: the guard passes it once, its other references released here).

kvqueue's guards are known by identity (a registry of the functions made here), never by
an attribute, which ``functools.wraps`` would copy onto anyone's wrapper.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Iterable
from operator import index
from types import ModuleType
from typing import Any

from . import _block, _errors, _foreign, _policy, _report, _rules
from ._report import Note as _Note
from ._report import call as _call
from ._report import log_notes as _log_notes
from ._report import named as _named
from ._report import pool_repairs
from ._report import repaired as _repaired
from ._report import then_log as _then_log
from ._report import where as _where

__all__ = ("AUDITED", "GUARDED", "guard", "in_place", "originals", "pool_repairs", "unguard")

#: The methods guarded, in the order a request meets them.
GUARDED = ("get_new_blocks", "touch", "free_blocks", "unpin_blocks")
#: The ``KVCacheManager`` method the holder audit runs in: the first the scheduler calls in
#: a step, before any block is counted free for a request or handed out.
AUDITED = ("new_step_starts",)
#: What kvqueue corrects with the guard off, on a line that counts first (vLLM 0.23): its
#: ``free_blocks`` queues a block once per occurrence, which kvqueue's queue refuses after
#: vLLM released every count (the block would be lost), where the guard queues it once.
CORRECTED = ("free_blocks",)


class PoolPolicy:
    """A pool's misuse policy, decided here only: its queue's ``on_misuse``, else
    ``default`` (the one given to ``kvqueue.vllm.install()``; None: ``KVQUEUE_ON_MISUSE``,
    read at each call). kvqueue.vllm shares one between its guards and the queues it builds
    for vLLM, so that setting ``default`` changes both."""

    __slots__ = ("default",)

    def __init__(self, default: _policy.MisusePolicy | None = None) -> None:
        self.default = default

    def __call__(self, pool: Any) -> _policy.MisusePolicy:
        own = getattr(pool.free_block_queue, "on_misuse", None)
        return _policy.resolve(own if own in ("raise", "repair") else self.default)


_MISSING: Any = object()
_namespace = type.__dict__["__dict__"].__get__


class _Guard:
    """One guard kvqueue made: what it wraps, and how it screens."""

    __slots__ = (
        "__weakref__",
        "name",
        "original",
        "owner",
        "policy",
        "retired",
        "screen",
        "signature",
    )

    def __init__(
        self,
        owner: type,
        name: str,
        original: Callable[..., Any],
        screen: ModuleType,
        policy: PoolPolicy,
    ) -> None:
        self.owner = weakref.ref(owner)
        self.name = name
        self.original = original
        self.screen = screen
        self.policy = policy
        # A guard that a later patch wraps cannot be taken out from under it: retired
        # (unguard(), or a new guard over that patch), it does what vLLM's method does.
        self.retired = False
        try:
            self.signature: inspect.Signature | None = inspect.signature(original)
        except (TypeError, ValueError):
            self.signature = None  # a foreign callable without one: its own errors show


# The guards made here, by the id of their function. The entry holds the function
# weakly: it goes when the function does.
_made: dict[int, tuple[weakref.ref[Callable[..., Any]], _Guard]] = {}


def _ours(found: object) -> _Guard | None:
    """The guard ``found`` is, if kvqueue made it (by identity)."""
    entry = _made.get(id(found))
    if entry is None or entry[0]() is not found:
        return None
    return entry[1]


def _register(function: Callable[..., Any], made: _Guard) -> None:
    key = id(function)

    def forget(ref: weakref.ref[Callable[..., Any]]) -> None:
        if _made.get(key, (None,))[0] is ref:
            del _made[key]

    _made[key] = (weakref.ref(function, forget), made)


def originals(
    pool_class: type, *, wrap_foreign: bool, names: tuple[str, ...] = GUARDED
) -> dict[str, Any]:
    """The methods the guard would wrap (``names``: those of ``BlockPool``, or
    :data:`AUDITED` of ``KVCacheManager``), by name: vLLM's own (or what is there).

    Raises VLLMLayoutError if a method is neither vLLM's own nor kvqueue's guard,
    unless ``wrap_foreign``: then the guard wraps what is there.
    """
    found_methods: dict[str, Any] = {}
    namespace = _namespace(pool_class)
    for name in names:
        found = namespace.get(name)
        if found is None:
            continue
        made = _ours(found)
        if made is not None:
            found = made.original
        elif not wrap_foreign:
            patch = _foreign.method_patch(pool_class, name, found)
            if patch is not None:
                raise _errors.foreign_patch(patch, _foreign.METHOD_WRAPPED)
        found_methods[name] = found
    return found_methods


def in_place(pool_class: type, names: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """Of ``names`` (the methods kvqueue guarded on ``pool_class``), those whose guard is on
    the class now, and, by name, what replaced the others since: another project's later
    patch, which calls reach instead of the guard (bypassed). O(len(names))."""
    namespace = _namespace(pool_class)
    guarded: list[str] = []
    bypassed: dict[str, str] = {}
    for name in sorted(names):
        found = namespace.get(name)
        made = _ours(found)
        if made is not None and not made.retired:
            guarded.append(name)
        else:
            bypassed[name] = _foreign.method_patch(pool_class, name, found) or (
                f"{pool_class.__qualname__}.{name} is vLLM's own again"
            )
    return guarded, bypassed


def guard(
    pool_class: type,
    screen: ModuleType,
    policy: PoolPolicy,
    *,
    wrap_foreign: bool,
    line: Any,
    names: tuple[str, ...] = GUARDED,
    correct_only: bool = False,
) -> dict[str, Any]:
    """Replace each guarded method ``pool_class`` has with its guard for vLLM ``line``
    (a ``kvqueue._vllm_lines.Line``), under ``policy``; return the originals.
    ``correct_only``: with the guard off, :data:`CORRECTED` queues a block once, unscreened.

    A method that is kvqueue's guard already is replaced by the new guard in one
    assignment (no call between finds the method unguarded); one that another project
    patched over kvqueue's guard (``wrap_foreign``) is wrapped, and the guard beneath it
    retired, so that no call is screened twice. Raises as :func:`originals` does, before
    it changes anything.
    """
    replaced = originals(pool_class, wrap_foreign=wrap_foreign, names=names)
    namespace = _namespace(pool_class)
    made = {}
    for name, original in replaced.items():
        wrapper = _once_guard if correct_only else _WRAPPERS[name]
        made[name] = wrapper(_Guard(pool_class, name, original, screen, policy), line)
    for name, function in made.items():
        under = _ours(namespace.get(name)) is None
        _assign(pool_class, name, function)
        if under:
            _retire(pool_class, name, keep=function)
    return replaced


def unguard(pool_class: type, originals: dict[str, Any]) -> None:
    """Put back every original whose guard is still in place. A guard that a later patch
    wraps is left under it, retired: that patch then calls vLLM's method unguarded."""
    namespace = _namespace(pool_class)
    for name, original in originals.items():
        made = _ours(namespace.get(name))
        if made is not None and made.original is original:
            _assign(pool_class, name, original)
        _retire(pool_class, name)


def _assign(pool_class: type, name: str, value: object) -> None:
    """``setattr(pool_class, name, value)``, the method it replaces kept alive until the
    assignment has returned. CPython frees a replaced class attribute inside the assignment,
    before it invalidates the caches that hold it borrowed (the type's, each call site's);
    a guard's last reference freed there runs ``forget``, where threads can switch, and a
    call on another thread found the freed function in its cache (SIGSEGV, issue 31)."""
    replaced = _namespace(pool_class).get(name)
    setattr(pool_class, name, value)
    del replaced


def _retire(pool_class: type, name: str, keep: object = None) -> None:
    for ref, made in list(_made.values()):
        if made.owner() is pool_class and made.name == name and ref() is not keep:
            made.retired = True


def _wrapped(made: _Guard, guarded: Callable[..., Any]) -> Callable[..., Any]:
    functools.update_wrapper(guarded, made.original)
    _register(guarded, made)
    return guarded


def _parameter(line: Any, name: str) -> str:
    """The name of the first parameter after ``self`` of ``name`` on ``line``."""
    return str(line.pool_methods[name][0])


def _binds(made: _Guard, pool: Any, first: Any, args: tuple[Any, ...], kwargs: Any) -> bool:
    """Whether vLLM's method accepts these arguments (else it raises, before it does
    anything, and the guard lets it: a repair is made for a call that runs)."""
    if made.signature is None:
        return True
    try:
        made.signature.bind(pool, first, *args, **kwargs)
    except TypeError:
        return False
    return True


def _free_guard(made: _Guard, line: Any) -> Callable[..., Any]:
    original = made.original
    first_excess = made.screen.first_excess
    freed = _report.freed
    own = line.has_pool_field
    weak = line.weak_pool
    parameter = _parameter(line, made.name)

    def guarded(self: Any, blocks: Any = _MISSING, /, *args: Any, **kwargs: Any) -> Any:
        if blocks is _MISSING:
            blocks = kwargs.pop(parameter, _MISSING)
            if blocks is _MISSING:
                return original(self, *args, **kwargs)
        elif kwargs and parameter in kwargs:
            return original(self, blocks, *args, **kwargs)
        # vLLM iterates its argument once; a list made here is what it iterates,
        # so what was screened is what is freed.
        blocks = list(blocks)
        freed(blocks)
        # What the pool's own blocks hold as their pool (line.pool_ref, inlined: every call).
        found = first_excess(blocks, self._weak_self if weak else self if own else None)
        if found == -1:
            return original(self, blocks, *args, **kwargs)
        return _free(made, line, self, blocks, args, kwargs)

    return _wrapped(made, guarded)


def _once_guard(made: _Guard, line: Any) -> Callable[..., Any]:
    original = made.original
    parameter = _parameter(line, made.name)

    def free_blocks(self: Any, blocks: Any = _MISSING, /, *args: Any, **kwargs: Any) -> Any:
        if blocks is _MISSING:
            blocks = kwargs.pop(parameter, _MISSING)
            if blocks is _MISSING:
                return original(self, *args, **kwargs)
        elif kwargs and parameter in kwargs:
            return original(self, blocks, *args, **kwargs)
        blocks = list(blocks)
        if made.retired or len({id(block) for block in blocks}) == len(blocks):
            return original(self, blocks, *args, **kwargs)
        refs = {id(b): b.ref_cnt for b in blocks if type(b.ref_cnt) is int and not b.is_null}
        return original(self, _once_each(refs, blocks), *args, **kwargs)

    return _wrapped(made, free_blocks)


def _touch_guard(made: _Guard, line: Any) -> Callable[..., Any]:
    original = made.original
    first_negative = made.screen.first_negative
    own = line.has_pool_field
    weak = line.weak_pool
    parameter = _parameter(line, made.name)

    def touch(self: Any, blocks: Any = _MISSING, /, *args: Any, **kwargs: Any) -> Any:
        if blocks is _MISSING:
            blocks = kwargs.pop(parameter, _MISSING)
            if blocks is _MISSING:
                return original(self, *args, **kwargs)
        elif kwargs and parameter in kwargs:
            return original(self, blocks, *args, **kwargs)
        blocks = list(blocks)
        i = first_negative(blocks, self._weak_self if weak else self if own else None)
        if i < 0:
            return original(self, blocks, *args, **kwargs)
        return _touch(made, line, self, blocks, i, args, kwargs)

    return _wrapped(made, touch)


def _alloc_guard(made: _Guard, line: Any) -> Callable[..., Any]:
    original = made.original
    first_held_free = made.screen.first_held_free
    parameter = _parameter(line, made.name)

    def get_new_blocks(self: Any, num_blocks: Any = _MISSING, /, *args: Any, **kwargs: Any) -> Any:
        if num_blocks is _MISSING:
            num_blocks = kwargs.pop(parameter, _MISSING)
            if num_blocks is _MISSING:
                return original(self, *args, **kwargs)
        elif kwargs and parameter in kwargs:
            return original(self, num_blocks, *args, **kwargs)
        if type(num_blocks) is not int:
            # What vLLM's queue takes as a count (a bool, an int subclass, an __index__)
            # is screened by its value, and that value is what vLLM is given.
            try:
                num_blocks = index(num_blocks)
            except TypeError:
                return original(self, num_blocks, *args, **kwargs)
        queue = self.free_block_queue
        # Asked for more than is free, or for none: vLLM's own answer, from vLLM.
        if 0 < num_blocks <= queue.num_free_blocks:
            block = first_held_free(queue.fake_free_list_head, num_blocks)
            if block is not None:
                return _alloc(made, self, num_blocks, args, kwargs)
        return original(self, num_blocks, *args, **kwargs)

    return _wrapped(made, get_new_blocks)


def _step_guard(made: _Guard, line: Any) -> Callable[..., Any]:
    original = made.original
    audit = _rules.audit_holders
    screen = made.screen
    every = _rules.audit_every()

    def new_step_starts(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not made.retired:
            audit(self, screen, made.policy, every)
        return original(self, *args, **kwargs)

    return _wrapped(made, new_step_starts)


_WRAPPERS: dict[str, Callable[[_Guard, Any], Callable[..., Any]]] = {
    "free_blocks": _free_guard,
    "unpin_blocks": _free_guard,
    "touch": _touch_guard,
    "get_new_blocks": _alloc_guard,
    "new_step_starts": _step_guard,
}


class _Plan:
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
            elif not _in_pool(pool, block):
                self.kept.append(block)
                continue
            if block.is_null:
                self.kept.append(block)
                continue
            key = id(block)
            if key not in left:
                linked = block.prev_free_block is not None
                refs = _count(pool, method, block)
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


def _in_pool(pool: Any, block: Any) -> bool:
    """Before vLLM 0.30 a block names no pool: it is the pool's own if the pool's list holds
    it at its id. vLLM's tests free blocks they made outside any pool, which keep vLLM's
    handling (the screens, which count every block, only send such a call here)."""
    blocks = vars(pool).get("blocks") if hasattr(pool, "__dict__") else None
    block_id = block.block_id
    return (
        type(blocks) is list
        and type(block_id) is int
        and 0 <= block_id < len(blocks)
        and blocks[block_id] is block
    )


def _count(pool: Any, method: str, block: Any) -> int:
    """``block.ref_cnt`` as an int; TypeError (bad input, under any policy) if it is not."""
    value = block.ref_cnt
    if type(value) is int:
        return value
    if _block.is_subtype(type(value), int):
        return int.__index__(value)
    raise _errors.ref_not_an_integer(_call(method), _named(block), value, _where(pool))


def _free(
    made: _Guard,
    line: Any,
    pool: Any,
    blocks: list[Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    original = made.original
    if made.retired or not _binds(made, pool, blocks, args, kwargs):
        return original(pool, blocks, *args, **kwargs)
    method = made.name
    plan = _Plan(pool, blocks, line, method)
    if (plan.dropped or plan.linked or plan.strays) and made.policy(pool) == "raise":
        if plan.dropped or plan.linked:
            _raise_double_free(pool, method, plan)
        _screen_strays(pool, method, plan.strays)
    # Under their own "raise", other pools' blocks are screened before anything is freed
    # here: vLLM frees this pool's blocks first, then hands those over.
    if method == "free_blocks":
        for owner, group in plan.others.values():
            _screen_other(owner, group, line)
    notes: list[_Note] = []
    queue = pool.free_block_queue
    for block in plan.linked:
        queue.remove(block)
        _repaired(pool, method, block, "held_free", notes)
    for block in plan.dropped:
        _repaired(pool, method, block, "double_free", notes)
    kept = plan.kept
    if line.counts_first and method == "free_blocks":
        kept = _once_each(plan.refs, kept)
    return _then_log(notes, original, pool, kept, *args, **kwargs)


def _raise_double_free(pool: Any, method: str, plan: _Plan) -> None:
    block = (plan.dropped + plan.linked)[0]
    key = id(block)
    _report.count_refusal(method, "double_free" if plan.dropped else "held_free")
    raise _errors.double_free(
        _call(method),
        _named(block),
        plan.given[key],
        plan.refs[key],
        key in plan.in_list,
        _where(pool),
    )


def _screen_strays(pool: Any, method: str, strays: list[Any]) -> None:
    """Raise for a stray block this call would take to 0 (vLLM would queue it here, where
    the queue refuses it after every count moved); one that keeps a reference, or whose
    count goes below 0 from 0 or less (never queued: some of vLLM's tests do so), is vLLM's."""
    for block in strays:
        if block.is_null:
            continue
        given = sum(1 for each in strays if each is block)
        refs = _count(pool, method, block)
        if not 1 <= refs <= given:
            continue
        owner = block.pool
        if type(owner) is weakref.ref:  # vLLM 0.34+: the pool it refers to, if alive
            owner = owner()
        whose = "no pool" if owner is None else f"another pool (BlockPool at {id(owner):#x})"
        raise _errors.stray_block(_call(method), _named(block), whose, refs, given, _where(pool))


def _screen_other(owner: Any, group: list[Any], line: Any) -> None:
    """Raise now what ``owner``'s guard would raise when vLLM hands it ``group``."""
    made = _ours(_block.lookup(type(owner), "free_blocks"))
    if made is None or made.retired or made.policy(owner) != "raise":
        return
    if made.screen.first_excess(group, line.pool_ref(owner)) >= 0:
        plan = _Plan(owner, group, line, "free_blocks")
        if plan.dropped or plan.linked:
            _raise_double_free(owner, "free_blocks", plan)


def _once_each(refs: dict[int, int], kept: list[Any]) -> list[Any]:
    """``kept`` with each block that its occurrences take to 0 (``refs``: its ``ref_cnt``
    by id) once, at its first place, its other references released here: vLLM 0.23 would
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


def _touch(
    made: _Guard,
    line: Any,
    pool: Any,
    blocks: list[Any],
    first: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    original = made.original
    if made.retired or not _binds(made, pool, blocks, args, kwargs):
        return original(pool, blocks, *args, **kwargs)
    own = line.has_pool_field
    ref = line.pool_ref(pool)
    # The fields in the screen's order; _count last, as the screen's ref_cnt read.
    negative = [
        block
        for block in blocks[first:]
        if (block.pool is ref if own else _in_pool(pool, block))
        and not block.is_null
        and _count(pool, "touch", block) < 0
    ]
    if negative and made.policy(pool) == "raise":
        block = negative[0]
        _report.count_refusal("touch", "negative_ref")
        raise _errors.touch_negative(
            _call("touch"), _named(block), _count(pool, "touch", block), _where(pool)
        )
    notes: list[_Note] = []
    for block in negative:
        block.ref_cnt = 0
        _repaired(pool, "touch", block, "negative_ref", notes)
    return _then_log(notes, original, pool, blocks, *args, **kwargs)


def _alloc(
    made: _Guard, pool: Any, num_blocks: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``get_new_blocks`` when a block among the first ``num_blocks`` free ones has a
    ``ref_cnt`` that is not 0: one walk along the free list, O(num_blocks + repairs), or
    O(free blocks) once when one is held."""
    original = made.original
    if made.retired or not _binds(made, pool, num_blocks, args, kwargs):
        return original(pool, num_blocks, *args, **kwargs)
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
        refs = _count(pool, "get_new_blocks", block)
        if refs > 0:
            bad.append((block, refs))
            held = True
        elif taken < num_blocks:
            taken += 1
            if refs < 0:
                bad.append((block, refs))
        block = block.next_free_block
    if not bad:  # code a block ran during the walk took the misuse away
        return original(pool, num_blocks, *args, **kwargs)
    if made.policy(pool) == "raise":
        block, refs = bad[0]
        _report.count_refusal("get_new_blocks", "held_free" if refs > 0 else "negative_ref")
        raise _errors.held_handed_out(_call("get_new_blocks"), _named(block), refs, _where(pool))
    notes: list[_Note] = []
    for block, refs in bad:
        if refs < 0:
            block.ref_cnt = 0
            _repaired(pool, "get_new_blocks", block, "negative_ref", notes)
            continue
        queue.remove(block)
        if block.prev_free_block is not None or block.next_free_block is not None:
            # The queue would not take it out (its pool or links were reassigned while it
            # was linked): handed out, it would have two holders.
            _log_notes(notes)
            raise _errors.held_stuck(_call("get_new_blocks"), _named(block), refs, _where(pool))
        _repaired(pool, "get_new_blocks", block, "held_free", notes)
    return _then_log(notes, original, pool, num_blocks, *args, **kwargs)
