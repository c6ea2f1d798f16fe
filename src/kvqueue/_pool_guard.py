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
import sys
import weakref
from collections.abc import Callable
from operator import index
from types import ModuleType
from typing import Any

from . import _block, _errors, _foreign, _log, _policy

__all__ = ("GUARDED", "guard", "originals", "pool_repairs", "unguard")

#: The methods guarded, in the order a request meets them.
GUARDED = ("get_new_blocks", "touch", "free_blocks", "unpin_blocks")

PolicyOf = Callable[[Any], _policy.MisusePolicy]

# Per pool, weakly: a pool's counters go with it.
_repairs: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()

_MISSING: Any = object()
_namespace = type.__dict__["__dict__"].__get__


class _Guard:
    """One guard kvqueue made: what it wraps, and how it screens."""

    __slots__ = (
        "__weakref__",
        "name",
        "original",
        "owner",
        "policy_of",
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
        policy_of: PolicyOf,
    ) -> None:
        self.owner = weakref.ref(owner)
        self.name = name
        self.original = original
        self.screen = screen
        self.policy_of = policy_of
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


def pool_repairs(pool: object) -> dict[str, int]:
    """The repairs the guard made on ``pool``, by kind (all 0 for a pool it never repaired)."""
    return dict(_repairs.get(pool) or dict.fromkeys(_errors.POOL_MISUSES, 0))


def originals(pool_class: type, *, wrap_foreign: bool) -> dict[str, Any]:
    """The methods the guard would wrap, by name: vLLM's own (or what is there).

    Raises VLLMLayoutError if a method is neither vLLM's own nor kvqueue's guard,
    unless ``wrap_foreign``: then the guard wraps what is there.
    """
    found_methods: dict[str, Any] = {}
    namespace = _namespace(pool_class)
    for name in GUARDED:
        found = namespace.get(name)
        if found is None:
            continue
        made = _ours(found)
        if made is not None:
            found = made.original
        elif not wrap_foreign:
            patch = _foreign.method_patch(pool_class, name, found)
            if patch is not None:
                raise _foreign.refused(patch, _foreign.METHOD_WRAPPED)
        found_methods[name] = found
    return found_methods


def guard(
    pool_class: type,
    screen: ModuleType,
    policy_of: PolicyOf,
    *,
    wrap_foreign: bool,
    line: Any,
) -> dict[str, Any]:
    """Replace each guarded method ``pool_class`` has with its guard for vLLM ``line``
    (a ``kvqueue._vllm_lines.Line``); return the originals.

    A method that is kvqueue's guard already is replaced by the new guard in one
    assignment (no call between finds the method unguarded); one that another project
    patched over kvqueue's guard (``wrap_foreign``) is wrapped, and the guard beneath it
    retired, so that no call is screened twice. Raises as :func:`originals` does, before
    it changes anything.
    """
    replaced = originals(pool_class, wrap_foreign=wrap_foreign)
    namespace = _namespace(pool_class)
    made = {}
    for name, original in replaced.items():
        made[name] = _WRAPPERS[name](_Guard(pool_class, name, original, screen, policy_of), line)
    for name, function in made.items():
        under = _ours(namespace.get(name)) is None
        setattr(pool_class, name, function)
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
            setattr(pool_class, name, original)
        _retire(pool_class, name)


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
        # What the pool's own blocks hold as their pool (line.pool_ref, inlined: every call).
        found = first_excess(blocks, self._weak_self if weak else self if own else None)
        if found == -1:
            return original(self, blocks, *args, **kwargs)
        return _free(made, line, self, blocks, args, kwargs)

    return _wrapped(made, guarded)


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


_WRAPPERS: dict[str, Callable[[_Guard, Any], Callable[..., Any]]] = {
    "free_blocks": _free_guard,
    "unpin_blocks": _free_guard,
    "touch": _touch_guard,
    "get_new_blocks": _alloc_guard,
}


class _Plan:
    """What a free of ``blocks`` on ``pool`` would do, read once (nothing changed)."""

    __slots__ = ("dropped", "given", "in_list", "kept", "linked", "others", "refs")

    def __init__(self, pool: Any, blocks: list[Any], line: Any, method: str) -> None:
        self.kept: list[Any] = []
        self.dropped: list[Any] = []
        # Held blocks found linked in the free list (a reference taken without touch()).
        self.linked: list[Any] = []
        # Other pools' blocks, by pool, in the order vLLM hands them over.
        self.others: dict[int, tuple[Any, list[Any]]] = {}
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
                    if owner is not None and line.weak_pool:
                        # vLLM 0.34+ hands the block to the pool it refers to, and skips
                        # it if that pool is gone. Only an exact weakref is called here, as
                        # in the screens: no code of the block's runs.
                        owner = owner() if type(owner) is weakref.ref else None
                    if owner is not None:
                        self.others.setdefault(id(owner), (owner, []))[1].append(block)
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
    raise TypeError(
        f"{_call(method)} was given block {_named(block)} whose ref_cnt is "
        f"{_errors.describe(value)}, not an integer; nothing was changed. {_where(pool)}"
    )


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
    if (plan.dropped or plan.linked) and made.policy_of(pool) == "raise":
        _raise_double_free(pool, method, plan)
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
        kept = _once_each(plan, kept)
    return _then_log(notes, original, pool, kept, *args, **kwargs)


def _raise_double_free(pool: Any, method: str, plan: _Plan) -> None:
    block = (plan.dropped + plan.linked)[0]
    key = id(block)
    refs = _errors.number(plan.refs[key])
    if key in plan.in_list:
        what = f"which is in the free list already (ref_cnt {refs})"
    else:
        what = f"while it holds {refs} reference(s)"
    raise ValueError(
        f"{_call(method)} was given block {_named(block)} {plan.given[key]} time(s) "
        f"{what}: a double free; nothing was freed. {_where(pool)}"
    )


def _screen_other(owner: Any, group: list[Any], line: Any) -> None:
    """Raise now what ``owner``'s guard would raise when vLLM hands it ``group``."""
    made = _ours(_block.lookup(type(owner), "free_blocks"))
    if made is None or made.retired or made.policy_of(owner) != "raise":
        return
    if made.screen.first_excess(group, line.pool_ref(owner)) >= 0:
        plan = _Plan(owner, group, line, "free_blocks")
        if plan.dropped or plan.linked:
            _raise_double_free(owner, "free_blocks", plan)


def _once_each(plan: _Plan, kept: list[Any]) -> list[Any]:
    """``kept`` with each block that its occurrences take to 0 once, at its first place,
    its other references released here: vLLM 0.23 would queue it once per occurrence."""
    times: dict[int, int] = {}
    for block in kept:
        times[id(block)] = times.get(id(block), 0) + 1
    once: list[Any] = []
    released: set[int] = set()
    for block in kept:
        key = id(block)
        count = times[key]
        if count < 2 or plan.refs.get(key) != count:
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
    if negative and made.policy_of(pool) == "raise":
        block = negative[0]
        raise ValueError(
            f"{_call('touch')} was given block {_named(block)} whose ref_cnt is "
            f"{_errors.number(_count(pool, 'touch', block))}: it was freed more times than "
            f"it was referenced (a double free), and a touch would count it free and held "
            f"at once; nothing was touched. {_where(pool)}"
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
    if made.policy_of(pool) == "raise":
        block, refs = bad[0]
        raise ValueError(
            f"{_call('get_new_blocks')} would hand out block {_named(block)}, which "
            f"is in the free list with ref_cnt {_errors.number(refs)} (0 for a free block): a "
            f"double free made it both free and held; nothing was allocated. {_where(pool)}"
        )
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
            raise RuntimeError(
                f"{_call('get_new_blocks')}: held block {_named(block)} (ref_cnt "
                f"{_errors.number(refs)}) is in the free list, and the queue cannot unlink "
                f"it: were its pool or links assigned outside the queue? Nothing was "
                f"allocated. {_where(pool)}"
            )
        _repaired(pool, "get_new_blocks", block, "held_free", notes)
    return _then_log(notes, original, pool, num_blocks, *args, **kwargs)


# A repair to log: (message arguments). Logged once vLLM's method has run, so that
# a logging handler that calls back into the pool finds it whole.
_Note = tuple[Any, ...]


def _repaired(
    pool: Any, method: str, block: Any, kind: _errors.PoolMisuse, notes: list[_Note]
) -> None:
    counts = _repairs.get(pool)
    if counts is None:
        counts = _repairs[pool] = dict.fromkeys(_errors.POOL_MISUSES, 0)
    counts[kind] += 1
    notes.append((_call(method), kind, counts[kind], _named(block), _errors.REPAIRED[kind], pool))


def _then_log(notes: list[_Note], original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """vLLM's method, then the repairs' log lines (even if it raised)."""
    try:
        return original(*args, **kwargs)
    finally:
        _log_notes(notes)


def _log_notes(notes: list[_Note]) -> None:
    for *note, pool in notes:
        _log.repaired(
            "%s repaired a double free (%s #%d on this pool): block %s: %s. %s",
            *note,
            _where(pool),
        )


def _named(block: Any) -> str:
    """A block for a message: its ``block_id`` from its slot, else as ``describe`` has it;
    no code of the block's runs."""
    found = _errors.block_id(block)
    return _errors.describe(block) if found is None else _errors.number(found)


def _call(method: str) -> str:
    return f"BlockPool.{method}()"


def _where(pool: Any) -> str:
    """Which pool, and the caller of the guarded method (the code that misused it)."""
    # The first frame outside this file (whose guards are the methods called) is the caller.
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    site = "unknown"
    if frame is not None:
        # An installed package by its import path (vllm/v1/core/...), else the file's tail.
        path = frame.f_code.co_filename.replace("\\", "/")
        path = path.rpartition("-packages/")[2] or path
        site = f"{'/'.join(path.split('/')[-4:])}:{frame.f_lineno} in {frame.f_code.co_name}"
    blocks = getattr(pool, "num_gpu_blocks", "?")
    return f"Pool: BlockPool at {id(pool):#x} ({blocks} blocks); called from {site}"
