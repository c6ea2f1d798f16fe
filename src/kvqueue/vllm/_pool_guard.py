"""The pool guard: vLLM's ``BlockPool`` methods that move reference counts, checked first.

A double free that never reaches a queue call (vLLM issue 42571: one block twice in
one ``free_blocks()`` call takes its ``ref_cnt`` 1, 0, -1 and links it once) is seen
where the count moves. This module keeps the registry of the guards kvqueue made and
the adapters that replace each method: an adapter binds the method's first argument by
the line's parameter name, screens it (the twins ``_screen.pyx`` / ``_screen_py.py``:
read only, O(blocks)) and calls vLLM's own method when the screen finds nothing, so the
guard follows whatever the installed vLLM does. What the screen flags goes to that
method's rule in ``_rules``, which refuses or repairs it under the pool's policy
(:class:`PoolPolicy`: its queue's ``on_misuse``, else the one given to ``install()``).

Each guard follows its vLLM line (``kvqueue.vllm._lines.Line``): the parameters of the
method it wraps (0.34's ``free_blocks`` takes ``evict_first`` too, passed on as given),
whether blocks name their pool (0.30+) and how (0.34+: by a weak reference, the pool's
``_weak_self``), and whether ``free_blocks`` decrements every occurrence before it queues
any (0.18-0.23, which would queue a block listed twice twice: the guard passes it once, its
other references released here, and so does the correction made with the guard off).

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

from .. import _block, _env, _errors, _policy
from . import _audit, _foreign, _index, _registry, _report, _rules
from ._report import pool_repairs

__all__ = (
    "AUDITED",
    "GUARDED",
    "door",
    "guard",
    "in_place",
    "is_door",
    "originals",
    "pool_repairs",
    "screens",
    "unguard",
)

#: The methods guarded, in the order a request meets them (``_registry``).
GUARDED = tuple(_registry.GUARDED)
#: The ``KVCacheManager`` method the holder audit runs in.
AUDITED = (_registry.AUDIT_HOOK,)
CORRECTED = _registry.CORRECTED


class PoolPolicy:
    """A pool's misuse policy, decided here only: its queue's ``on_misuse``, else
    ``default`` (the one given to ``kvqueue.vllm.install()``; None: ``KVQUEUE_ON_MISUSE``,
    read at each call). kvqueue.vllm shares one between its guards and the queues it builds
    for vLLM, so that setting ``default`` changes both; and ``every``, the steps between the
    holder audit's full reads, which each ``install()`` sets."""

    __slots__ = ("default", "every")

    def __init__(self, default: _policy.MisusePolicy | None = None) -> None:
        self.default = default
        self.every = _env.EVERY_DEFAULT

    def __call__(self, pool: Any) -> _policy.MisusePolicy:
        own = getattr(pool.free_block_queue, "on_misuse", None)
        return _policy.resolve(own if own in ("raise", "repair") else self.default)


def screens(twin: str) -> ModuleType:
    """The screens of twin ``twin`` (``"cython"`` or ``"python"``): a guard screens with
    the twin its pool's queue is, compiled with compiled."""
    if twin == "cython":
        from . import _screen

        return _screen
    from . import _screen_py

    return _screen_py


_MISSING: Any = object()
# What an adapter hands its first argument to: (pool, first, args, kwargs) -> vLLM's result.
Rule = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]
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

    # The registry bound here: a guard freed at the interpreter's exit, after this module's
    # globals are cleared, still finds it.
    def forget(ref: weakref.ref[Callable[..., Any]], made_here: dict[int, Any] = _made) -> None:
        if made_here.get(key, (None,))[0] is ref:
            del made_here[key]

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
    (a ``kvqueue.vllm._lines.Line``), under ``policy``; return the originals.
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
    call on another thread found the freed function in its cache (SIGSEGV)."""
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


def _adapter(
    made: _Guard,
    line: Any,
    rule: Rule,
    passing: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> Callable[..., Any]:
    """The guard of one method: its first argument bound by position or by the line's name
    for it, and handed to ``rule`` (the screen, then vLLM's method or the slow path). A call
    vLLM's method would refuse (no first argument, or it twice) goes to vLLM as it is.
    ``passing``: the twin's guard of the path vLLM takes, made over this one, which it calls
    for every other."""
    original = made.original
    parameter = _parameter(line, made.name)

    def guarded(self: Any, first: Any = _MISSING, /, *args: Any, **kwargs: Any) -> Any:
        if first is _MISSING:
            first = kwargs.pop(parameter, _MISSING)
            if first is _MISSING:
                return original(self, *args, **kwargs)
        elif kwargs and parameter in kwargs:
            return original(self, first, *args, **kwargs)
        return rule(self, first, args, kwargs)

    return _wrapped(made, guarded if passing is None else passing(guarded))


def _free_guard(made: _Guard, line: Any) -> Callable[..., Any]:
    original = made.original
    first_excess = made.screen.first_excess
    first_under_listed = made.screen.first_under_listed
    freed = _report.freed
    own = line.has_pool_field
    weak = line.weak_pool
    # A release is checked against the listings at free_blocks; unpin_blocks releases
    # HiSparse's pages, whose listings the holder index leaves to their managers.
    releases = made.name == "free_blocks"

    def screened(
        self: Any,
        blocks: list[Any],
        args: tuple[Any, ...],
        kwargs: Any,
        index: _index.Index | None,
    ) -> Any:
        # What the pool's own blocks hold as their pool (line.pool_ref, inlined: every call).
        found = first_excess(blocks, self._weak_self if weak else self if own else None)
        if found == -1 and (
            index is None or first_under_listed(blocks, index.counts, index.blocks) < 0
        ):
            return original(self, blocks, *args, **kwargs)
        return _slow(
            made,
            self,
            blocks,
            args,
            kwargs,
            lambda call: _free(made, line, self, blocks, call, index),
        )

    def free(self: Any, blocks: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # vLLM iterates its argument once; a list made here is what it iterates,
        # so what was screened is what is freed.
        blocks = list(blocks)
        door: Any = getattr(self.free_block_queue, "gate", None)
        if not is_door(door):
            freed(blocks)
            return screened(self, blocks, args, kwargs, None)
        # A free screened here passes the free list's entry: its releases are checked here
        # against the holder index, before vLLM's method moves a count (so the audit need not
        # read them again, nor name them).
        if not releases:
            freed(blocks)
        door.freeing += 1
        try:
            return screened(self, blocks, args, kwargs, door.index if releases else None)
        finally:
            door.freeing -= 1

    def passing(slow: Callable[..., Any]) -> Callable[..., Any]:
        guards: Any = made.screen
        made_here: Callable[..., Any] = guards.free_guard(
            original, slow, freed, own, weak, releases
        )
        return made_here

    return _adapter(made, line, free, passing)


def _stopped(door: Any, method: str, blocks: Any) -> Any:
    """What a pool's door (the twins' ``Door``) stopped: to the free list's entry rule, or,
    with the guard off, let in as vLLM's queue would."""
    pool = door.pool()
    made = None if pool is None else _free_guard_of(pool)
    if made is None:  # the guard is off: vLLM's queue as it is
        # A listed block let in: the free list's exit reads the index again while it is.
        door.index.let_in(blocks)
        return blocks
    return _audit.enter(pool, method, blocks, door.index, made.policy)


# The twins' door types made here (of the screens a guard ran with): a gate is kvqueue's
# door only if its type is one of these, by identity.
_DOORS: set[type] = set()


def is_door(gate: object) -> bool:
    """Whether ``gate`` (a queue's) is a door kvqueue gave it."""
    return type(gate) in _DOORS


def door(pool: Any, index: _index.Index) -> None:
    """Give ``pool``'s queue (kvqueue's, without a gate) the free list's entry check (its
    guard's twin's ``Door``: a block that holds a reference, or that a live request lists,
    is not queued free by anything but the pool's guarded frees), if the pool's
    ``free_blocks`` is kvqueue's guard; a door the pool's queue has already is given
    ``index``, the pool's new one (a free reads the index there)."""
    queue: Any = getattr(pool, "free_block_queue", None)
    gate = getattr(queue, "gate", _MISSING)
    made = _free_guard_of(pool)
    if is_door(gate) and gate.pool() is pool:
        gate.index = index
    elif made is not None and gate is None:
        kind = made.screen.Door
        _DOORS.add(kind)
        queue.gate = kind(weakref.ref(pool), index, _stopped)


def _once_guard(made: _Guard, line: Any) -> Callable[..., Any]:
    original = made.original

    def free_once(self: Any, blocks: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        blocks = list(blocks)
        if made.retired or len({id(block) for block in blocks}) == len(blocks):
            return original(self, blocks, *args, **kwargs)
        refs = {id(b): b.ref_cnt for b in blocks if type(b.ref_cnt) is int and not b.is_null}
        return original(self, _rules.once_each(refs, blocks), *args, **kwargs)

    return _adapter(made, line, free_once)


def _touch_guard(made: _Guard, line: Any) -> Callable[..., Any]:
    original = made.original
    first_negative = made.screen.first_negative
    first_listed_free = made.screen.first_listed_free
    index_of = _index.index_of
    own = line.has_pool_field
    weak = line.weak_pool

    def touch(self: Any, blocks: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        blocks = list(blocks)
        i = first_negative(blocks, self._weak_self if weak else self if own else None)
        if i < 0:
            # A prefix hit takes a block out of the free list's middle: not one a live
            # request lists.
            held = index_of(self)
            if held is None or first_listed_free(blocks, held.counts, held.blocks) < 0:
                return original(self, blocks, *args, **kwargs)
            return _slow(
                made,
                self,
                blocks,
                args,
                kwargs,
                lambda call: _audit.touch_listed(self, blocks, held, made.policy, call),
            )
        return _slow(
            made,
            self,
            blocks,
            args,
            kwargs,
            lambda call: _rules.touch(self, blocks, i, line, made.policy, call),
        )

    def passing(slow: Callable[..., Any]) -> Callable[..., Any]:
        guards: Any = made.screen
        made_here: Callable[..., Any] = guards.touch_guard(
            original, slow, _index.INDEXES, own, weak
        )
        return made_here

    return _adapter(made, line, touch, passing)


def _alloc_guard(made: _Guard, line: Any) -> Callable[..., Any]:
    original = made.original
    first_held_free = made.screen.first_held_free
    indexes = _index.INDEXES
    first_listed = made.screen.first_listed

    def alloc(self: Any, num_blocks: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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
            head = queue.fake_free_list_head
            block = first_held_free(head, num_blocks)
            if block is not None:
                return _slow(
                    made,
                    self,
                    num_blocks,
                    args,
                    kwargs,
                    lambda call: _rules.alloc(self, num_blocks, made.policy, call),
                )
            # The free list's exit: a block a live request lists is never handed out.
            # _index.index_of inlined: every hand-out looks its pool's index up.
            entry = indexes.get(id(self))
            held = entry[1] if entry is not None and entry[0]() is self else None
            if (
                held is not None
                and first_listed(head, num_blocks, held.counts, held.blocks) is not None
            ):
                return _slow(
                    made,
                    self,
                    num_blocks,
                    args,
                    kwargs,
                    lambda call: _audit.hand_out(
                        self, num_blocks, held, made.screen, made.policy, call
                    ),
                )
        return original(self, num_blocks, *args, **kwargs)

    def passing(slow: Callable[..., Any]) -> Callable[..., Any]:
        made_here: Callable[..., Any] = made.screen.alloc_guard(original, slow, indexes)
        return made_here

    return _adapter(made, line, alloc, passing)


def _step_guard(made: _Guard, line: Any) -> Callable[..., Any]:
    read_holders = _audit.read_holders
    screen = made.screen
    policy = made.policy

    def read(manager: Any, every: int) -> None:
        read_holders(manager, screen, policy, every)

    # The twin's: a step with nothing to read costs no call of the audit's (it runs at every
    # step, and starts with the audit's state out of the processor's cache).
    guarded: Callable[..., Any] = screen.step_guard(
        made.original, read, made, policy, _audit.PLACES, _report.TALLY
    )
    return _wrapped(made, guarded)


_WRAPPERS: dict[str, Callable[[_Guard, Any], Callable[..., Any]]] = {
    "free_blocks": _free_guard,
    "unpin_blocks": _free_guard,
    "touch": _touch_guard,
    "get_new_blocks": _alloc_guard,
    _registry.AUDIT_HOOK: _step_guard,
}


def _free_guard_of(pool: Any) -> _Guard | None:
    """``pool``'s ``free_blocks`` guard, if it is kvqueue's and in place."""
    made = _ours(_block.lookup(type(pool), "free_blocks"))
    return None if made is None or made.retired else made


def _free(
    made: _Guard,
    line: Any,
    pool: Any,
    blocks: list[Any],
    call: Callable[[list[Any]], Any],
    index: _index.Index | None,
) -> Any:
    """The free rule of what the screen flagged, handed the guard of each other pool the
    free gives blocks to (the rules never look a guard up) and, with ``index``, the check
    of each release against the holder index."""
    plan = _rules.FreePlan(pool, blocks, line, made.name)
    others: list[_rules.Other] = []
    for owner, group in plan.others.values():
        theirs = _free_guard_of(owner)
        if theirs is not None:
            others.append((owner, group, theirs.screen, theirs.policy))
    admit = None
    if index is not None:
        held = index

        def admit(kept: list[Any]) -> list[Any]:
            return _audit.release(pool, made.name, kept, held, made.policy)

    return _rules.free(pool, plan, line, made.name, made.policy, others, call, admit)


def _slow(
    made: _Guard,
    pool: Any,
    first: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rule: Callable[[Callable[[Any], Any]], Any],
) -> Any:
    """What a screen flagged, to ``rule`` with vLLM's method bound to the call's other
    arguments; a retired guard, or a call vLLM's method would refuse, goes to vLLM."""
    original = made.original
    if made.retired or not _binds(made, pool, first, args, kwargs):
        return original(pool, first, *args, **kwargs)
    return rule(lambda given: original(pool, given, *args, **kwargs))
