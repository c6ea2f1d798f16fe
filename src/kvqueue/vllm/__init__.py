"""Drop kvqueue's queue and pool guard into an installed vLLM: :func:`install`.

vLLM's ``BlockPool`` builds its free list with the name ``FreeKVCacheBlockQueue`` that
``vllm.v1.core.block_pool`` imports from ``vllm.v1.core.kv_cache_utils``. :func:`install`
rebinds that name, in every loaded ``vllm.*`` module that holds it, to a stand-in class whose
call builds kvqueue's queue (``isinstance`` against the name still holds), and guards the
``BlockPool`` methods that move reference counts (``kvqueue.vllm._pool_guard``). vLLM's own
``KVCacheBlock`` is left unchanged. Pools built after :func:`install` use kvqueue; pools built
before keep the queue they have.

Before it changes anything, :func:`install` checks the installed vLLM against the table of
accepted lines (``kvqueue.vllm._lines``, each proven by its own release's suites): its
version, its ``KVCacheBlock`` fields, its queue's methods and its pool's guarded methods.
Anything else raises :class:`VLLMLayoutError` and leaves vLLM untouched. Importing this
module does not import vLLM.

vLLM's plugin entry point (group ``vllm.general_plugins``) is ``kvqueue.vllm._plugin.plugin``,
which calls :func:`install` when ``KVQUEUE_VLLM`` asks. It patches the calling
process; vLLM's engine core runs in a child process, which a fork (vLLM's default) inherits
the patch into and which the plugin, called in every process vLLM starts, patches otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Literal

from .. import _env, _errors, _log, _policy, _twin
from .._block import check_block_type
from .._errors import HolderAuditError, VLLMLayoutError
from . import _foreign, _lines, _pool_guard, _registry
from ._index import guard_init, unguard_init
from ._lines import Line
from ._report import audit_findings, audited_steps, pool_repairs

__all__ = (
    "HolderAuditError",
    "Implementation",
    "VLLMLayoutError",
    "audit_findings",
    "audited_steps",
    "check",
    "install",
    "patched",
    "pool_repairs",
    "status",
    "uninstall",
)

Implementation = Literal["auto", "cython", "python"]

_UTILS = "vllm.v1.core.kv_cache_utils"
_POOL = "vllm.v1.core.block_pool"
_MANAGER = "vllm.v1.core.kv_cache_manager"
_TABLES = "vllm.v1.core.single_type_kv_cache_manager"
_NAME = "FreeKVCacheBlockQueue"


class _QueueName(type):
    """The metaclass of what vLLM's ``FreeKVCacheBlockQueue`` name is bound to by install().

    A class rather than a function, so that ``isinstance(queue, FreeKVCacheBlockQueue)``
    and attribute look-ups (``FreeKVCacheBlockQueue.popleft``) in vLLM's code keep working.
    """

    queue_class: type
    block_type: type
    policy: _pool_guard.PoolPolicy

    def __call__(
        cls,
        blocks: Any,
        *,
        block_type: type | None = None,
        on_misuse: _policy.MisusePolicy | None = None,
    ) -> Any:
        """kvqueue's queue of ``blocks`` for a vLLM pool, recorded for :func:`status`;
        O(len(blocks)). Its policy is decided here, once for the pool: ``on_misuse``, else
        install()'s, else ``KVQUEUE_ON_MISUSE`` now; the queue keeps it, and the pool's guard
        reads it there. Raises as the queue's constructor does, and ValueError for a bad
        ``KVQUEUE_ON_MISUSE``."""
        if block_type is None:
            if not isinstance(blocks, (list, tuple)):
                blocks = list(blocks)
            if not blocks:
                block_type = cls.block_type
        if on_misuse is None:
            on_misuse = _policy.resolve(cls.policy.default)
        queue = cls.queue_class(blocks, block_type=block_type, on_misuse=on_misuse)
        _pools[queue] = queue.num_free_blocks
        return queue

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, cls.queue_class)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, cls.queue_class)

    def __getattr__(cls, name: str) -> Any:
        return getattr(cls.queue_class, name)


# The queues built for vLLM's pools, weakly, each with the blocks it was built with: a pool's
# entry goes with its queue.
_pools: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _queue_name(queue_class: type, block_type: type, policy: _pool_guard.PoolPolicy) -> _QueueName:
    namespace = {
        "__module__": __name__,
        "__qualname__": _NAME,
        "__doc__": f"Builds {queue_class.__module__}.{queue_class.__qualname__} for vLLM.",
        "queue_class": queue_class,
        "block_type": block_type,
        "policy": policy,
    }
    return _QueueName(_NAME, (), namespace)


@dataclasses.dataclass
class _Installed:
    implementation: str
    queue_class: type
    # install()'s on_misuse, for the guards and the queues built for vLLM alike.
    policy: _pool_guard.PoolPolicy
    line: Line
    # What vLLM's FreeKVCacheBlockQueue name is bound to now, and vLLM's own class.
    bound: _QueueName
    original: type
    # vLLM's BlockPool methods the guard replaced (empty with the guard off), and the
    # KVCacheManager method the holder audit runs in (likewise).
    pool_class: type
    pool_originals: dict[str, Any]
    wrap_foreign: bool
    manager_class: type
    manager_originals: dict[str, Any] = dataclasses.field(default_factory=dict)
    # vLLM's SingleTypeKVCacheManager (None: this vLLM has none), whose __init__ ends, with
    # the guard on, in giving the manager its holder index's table; and vLLM's __init__.
    table_class: type | None = None
    table_originals: dict[str, Any] = dataclasses.field(default_factory=dict)
    # With the guard off: vLLM's BlockPool methods kvqueue's line correction replaced.
    corrected: dict[str, Any] = dataclasses.field(default_factory=dict)


_installed: _Installed | None = None
_lock = threading.RLock()


def install(
    implementation: Implementation = "auto",
    *,
    check_version: bool = True,
    on_misuse: _policy.MisusePolicy | None = None,
    pool_guard: bool = True,
    wrap_foreign: bool = False,
) -> type:
    """Make vLLM's block pools use kvqueue's ``FreeKVCacheBlockQueue`` and guard; return that class.

    ``implementation`` is ``"auto"`` (whatever ``import kvqueue`` picked), ``"cython"`` or
    ``"python"``; the pool guard's screens are the same twin's. ``on_misuse`` (``"raise"``,
    ``"repair"`` or None) is passed to every queue built through vLLM's name, unless the
    caller passes its own; None leaves the choice to ``KVQUEUE_ON_MISUSE``, read when each
    queue is built. A pool's guard follows its queue's policy. ``pool_guard=False`` leaves
    ``BlockPool``'s methods unguarded; on vLLM 0.18-0.23 its ``free_blocks`` is still corrected
    to queue once a block it is given as many times as it holds references (vLLM queues it
    once per occurrence, and kvqueue's queue, refusing that, would lose it). Calling it
    again is a no-op, or switches the implementation, the policy or the guard; a switch of
    twin replaces each guarded method in one step, so no call runs unguarded in between.
    ``check_version=False`` takes the accepted line whose layout this vLLM has, whatever its
    version says; the layout is always checked. ``wrap_foreign=True`` accepts a queue class
    or pool method that another project patched: the guard wraps that pool method, and
    kvqueue's queue replaces that queue (a warning names what is replaced).

    Raises :class:`VLLMLayoutError` on a vLLM it does not accept, or one another project
    patched (unless ``wrap_foreign``); ``ImportError`` when vLLM (or the requested
    implementation) cannot be imported; ValueError for an unknown ``implementation`` or
    ``on_misuse``, or a bad ``KVQUEUE_AUDIT_EVERY`` (read by each call: the holder audit
    keeps the value the last one read). On any error nothing is changed.
    """
    global _installed
    if on_misuse is not None:
        on_misuse = _policy.resolve(on_misuse)
    # Read here, at each install, and kept by the guard: a bad value raises before anything
    # changes.
    every = _env.audit_every()
    twin = _twin.named(implementation)
    queue_class, name, screen = twin.queue, twin.name, _pool_guard.screens(twin.name)
    with _lock:
        state = _installed
        if state is None:
            state = _checked(check_version, wrap_foreign, queue_class, name, on_misuse)
            # Every module is read before anything is written: a module whose attribute
            # access raises stops the install with nothing changed.
            targets = _holders(state.original)
            if pool_guard:
                _guard(state, screen)
            else:
                _correct(state, screen)
            _bind(targets, state.bound)
            state.policy.every = every
            _installed = state
        else:
            wrap_foreign = state.wrap_foreign or wrap_foreign
            rebind = state.queue_class is not queue_class
            targets = _holders(None) if rebind else []
            # A guard another project's later patch replaced is checked as a first install
            # checks it: refused, or (wrap_foreign) wrapped by a new guard.
            bypassed = _pool_guard.in_place(state.pool_class, state.pool_originals)[1]
            if pool_guard and (
                state.implementation != name or not state.pool_originals or bypassed
            ):
                if not state.pool_originals:
                    _originals(state, wrap_foreign)
                state.wrap_foreign = wrap_foreign
                _guard(state, screen)
            elif not pool_guard and state.pool_originals:
                _unguard(state)
                _correct(state, screen)
            state.wrap_foreign = wrap_foreign
            if rebind:
                state.bound = _queue_name(queue_class, state.bound.block_type, state.policy)
                _bind(targets, state.bound)
            state.queue_class, state.implementation = queue_class, name
            state.policy.default = on_misuse
            state.policy.every = every
        _log.forward_to_vllm(True)
        return queue_class


def _checked(
    check_version: bool,
    wrap_foreign: bool,
    queue_class: type,
    name: str,
    on_misuse: _policy.MisusePolicy | None,
) -> _Installed:
    """The state of a first install, from a vLLM checked to be one kvqueue can patch."""
    vllm = importlib.import_module("vllm")
    utils = importlib.import_module(_UTILS)
    # Importing the pool binds its own name to vLLM's class; that is the one used.
    pool = importlib.import_module(_POOL)
    original = vars(utils).get(_NAME)
    if not isinstance(original, type):
        raise VLLMLayoutError(f"{_UTILS} defines no {_NAME} class")
    block_class = vars(utils).get("KVCacheBlock")
    pool_class = vars(pool).get("BlockPool")
    if not isinstance(pool_class, type):
        raise VLLMLayoutError(f"{_POOL} defines no BlockPool class")
    manager_class = vars(importlib.import_module(_MANAGER)).get("KVCacheManager")
    if not isinstance(manager_class, type) or not callable(
        vars(manager_class).get(_registry.AUDIT_HOOK)
    ):
        raise VLLMLayoutError(f"{_MANAGER} defines no KVCacheManager.{_registry.AUDIT_HOOK}")
    table_class = _table_class()
    version = _version(vllm)
    line = _lines.line_of(version, block_class, original, pool_class, check_version=check_version)
    try:
        check_block_type(block_class)
    except TypeError as exc:
        raise VLLMLayoutError(f"{_UTILS}.KVCacheBlock: {exc}") from exc
    missing = sorted(m for m in line.queue_methods if not hasattr(queue_class, m))
    if missing:
        raise VLLMLayoutError(f"vLLM's {_NAME} has methods kvqueue's lacks: {', '.join(missing)}")
    foreign = _foreign.queue_patch(original, vars(pool).get(_NAME), _UTILS, _POOL, _NAME)
    if foreign and not wrap_foreign:
        raise _errors.foreign_patch(foreign, _foreign.QUEUE_WRAPPED)
    if foreign:
        _log.logger.warning("kvqueue: %s; kvqueue's queue replaces it (wrap_foreign)", foreign)
    assert isinstance(block_class, type)
    policy = _pool_guard.PoolPolicy(on_misuse)
    bound = _queue_name(queue_class, block_class, policy)
    return _Installed(
        name,
        queue_class,
        policy,
        line,
        bound,
        original,
        pool_class,
        {},
        wrap_foreign,
        manager_class,
        table_class=table_class,
    )


def _table_class() -> type | None:
    """vLLM's ``SingleTypeKVCacheManager``, or None where there is none (then the holder
    index is not kept, and the audit's full reads are what check the holders)."""
    try:
        found = vars(importlib.import_module(_TABLES)).get("SingleTypeKVCacheManager")
    except ImportError:
        return None
    return found if isinstance(found, type) else None


def _version(vllm: ModuleType) -> str | None:
    """vLLM's version as vLLM says it (``vllm.__version__``), else its distribution's."""
    version = vars(vllm).get("__version__")
    if isinstance(version, str):
        return version
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("vllm")
    except PackageNotFoundError:
        return None


def _guard(state: _Installed, screen: ModuleType) -> None:
    """The pool guard and the holder audit, ``screen``'s twin, in place of what was there
    (the line correction included). Both classes are checked before either is changed."""
    _originals(state, state.wrap_foreign)
    state.corrected = {}
    state.pool_originals = _guarded(state, state.pool_class, screen)
    state.manager_originals = _guarded(
        state, state.manager_class, screen, names=_pool_guard.AUDITED
    )
    if state.table_class is not None:
        state.table_originals = guard_init(state.table_class, _pool_guard.door, screen)


def _correct(state: _Installed, screen: ModuleType) -> None:
    """With the guard off, on a line that counts first: its correction
    (``_pool_guard.CORRECTED``), so that kvqueue's queue loses no block vLLM would keep."""
    if state.line.counts_first:
        state.corrected = _guarded(
            state, state.pool_class, screen, names=_pool_guard.CORRECTED, correct_only=True
        )


def _guarded(state: _Installed, cls: type, screen: ModuleType, **how: Any) -> dict[str, Any]:
    return _pool_guard.guard(
        cls, screen, state.policy, wrap_foreign=state.wrap_foreign, line=state.line, **how
    )


def _originals(state: _Installed, wrap_foreign: bool) -> None:
    """Raise as the guard would on a patched method of either class; change nothing."""
    _pool_guard.originals(state.pool_class, wrap_foreign=wrap_foreign)
    _pool_guard.originals(state.manager_class, wrap_foreign=wrap_foreign, names=_pool_guard.AUDITED)


def _unguard(state: _Installed) -> None:
    _pool_guard.unguard(state.pool_class, state.pool_originals or state.corrected)
    _pool_guard.unguard(state.manager_class, state.manager_originals)
    if state.table_class is not None:
        unguard_init(state.table_class, state.table_originals)
    state.pool_originals = {}
    state.manager_originals = {}
    state.table_originals = {}
    state.corrected = {}


def _holders(original: type | None) -> list[ModuleType]:
    """Every loaded ``vllm.*`` module whose name holds a kvqueue stand-in, or ``original``.

    Read from each module's namespace: a module's own ``__getattr__`` (vLLM's lazy imports)
    is never run, so no module can fail the scan.
    """
    found = []
    for key, module in list(sys.modules.items()):
        if not (key == "vllm" or key.startswith("vllm.")) or not isinstance(module, ModuleType):
            continue
        value = vars(module).get(_NAME)
        if type(value) is _QueueName or (original is not None and value is original):
            found.append(module)
    return found


def _bind(modules: list[ModuleType], value: Any) -> None:
    for module in modules:
        vars(module)[_NAME] = value


def uninstall() -> bool:
    """Give vLLM its own queue and pool methods back; False if kvqueue was not installed.

    Every ``vllm.*`` module whose name holds a kvqueue stand-in gets vLLM's class back,
    whenever it was imported. A name or method that someone else rebound after
    :func:`install` is left as they set it. Pools built while kvqueue was installed keep
    their kvqueue queues (and the policy they were built with), unguarded and, on vLLM
    0.18-0.23, uncorrected: a block freed there as many times as it holds references in one
    call is refused by the queue after vLLM released it, and lost. Build them again.
    """
    global _installed
    with _lock:
        state = _installed
        if state is None:
            return False
        targets = _holders(None)
        _unguard(state)
        _bind(targets, state.original)
        _installed = None
        _log.forward_to_vllm(False)
        return True


def status() -> dict[str, Any]:
    """What is installed into vLLM in this process, for logs and bug reports.

    ``implementation``: ``"cython"``, ``"python"`` or None (not installed); ``on_misuse``:
    the policy given to :func:`install` (None: ``KVQUEUE_ON_MISUSE`` decides per queue);
    ``line``: the vLLM line it was checked against (``"0.31"``); ``pool_guard``: whether
    ``BlockPool``'s methods are guarded, and ``guarded``: which, as the class has them now;
    ``bypassed``: the guarded methods another project patched since, each with what
    replaced it (calls reach that patch, not the guard; :func:`install` refuses it, or
    with ``wrap_foreign`` guards it again).
    ``holder_audit``: whether each scheduler step starts with the holder audit (it follows
    the pool guard), and ``audit_every``: the steps between its full reads, as the last
    :func:`install` read ``KVQUEUE_AUDIT_EVERY`` (None without the audit).
    ``pools``: each live pool whose queue kvqueue built for vLLM, oldest first, with the
    policy its guard follows (``on_misuse``, decided when the pool was built, kept after an
    :func:`uninstall` or another install) and the blocks it was built with (``blocks``).
    O(pools).
    """
    state = _installed
    guarded: list[str] = []
    bypassed: dict[str, str] = {}
    audited: list[str] = []
    if state is not None:
        guarded, bypassed = _pool_guard.in_place(state.pool_class, state.pool_originals)
        audited, skipped = _pool_guard.in_place(state.manager_class, state.manager_originals)
        bypassed.update({f"KVCacheManager.{name}": why for name, why in skipped.items()})
    return {
        "implementation": None if state is None else state.implementation,
        "on_misuse": None if state is None else state.policy.default,
        "line": None if state is None else state.line.name,
        "pool_guard": bool(guarded),
        "guarded": guarded,
        "bypassed": bypassed,
        "holder_audit": bool(audited),
        "audit_every": state.policy.every if state is not None and audited else None,
        "pools": [
            {"on_misuse": queue.on_misuse, "blocks": blocks}
            for queue, blocks in list(_pools.items())
        ],
    }


@contextmanager
def patched(
    implementation: Implementation = "auto",
    *,
    on_misuse: _policy.MisusePolicy | None = None,
    pool_guard: bool = True,
) -> Iterator[type]:
    """``with kvqueue.vllm.patched():`` install for the block only (as it was after)."""
    was = _installed
    before = (
        None if was is None else (was.implementation, was.policy.default, bool(was.pool_originals))
    )
    queue_class = install(implementation, on_misuse=on_misuse, pool_guard=pool_guard)
    try:
        yield queue_class
    finally:
        if before is None:
            uninstall()
        else:
            install(
                "cython" if before[0] == "cython" else "python",
                check_version=False,
                on_misuse=before[1],
                pool_guard=before[2],
            )


def check(implementation: Implementation = "auto", *, wrap_foreign: bool = False) -> None:
    """Raise what :func:`install` would raise on this vLLM, changing nothing.

    When kvqueue is installed already (that install was checked), only what changed since:
    a guarded method another project patched over the guard is refused as a first install
    refuses it, unless ``wrap_foreign``.
    """
    twin = _twin.named(implementation)
    queue_class, name = twin.queue, twin.name
    with _lock:
        if _installed is not None:
            pool_class = _installed.pool_class
            if _pool_guard.in_place(pool_class, _installed.pool_originals)[1]:
                wrap_foreign = wrap_foreign or _installed.wrap_foreign
                _pool_guard.originals(pool_class, wrap_foreign=wrap_foreign)
            return
        state = _checked(True, wrap_foreign, queue_class, name, None)
        _originals(state, wrap_foreign)
        _holders(state.original)
