"""Drop kvqueue's queue into an installed vLLM: ``kvqueue.vllm.install()``.

vLLM's ``BlockPool`` builds its free list with the name ``FreeKVCacheBlockQueue``
that ``vllm.v1.core.block_pool`` imports from ``vllm.v1.core.kv_cache_utils``.
:func:`install` rebinds that name, in both modules (and in any other loaded
``vllm.*`` module that imported it), to a stand-in class whose call builds kvqueue's
``FreeKVCacheBlockQueue`` (``isinstance`` against the name still holds). vLLM's own
``KVCacheBlock`` is left unchanged: the queue threads the blocks it is built from,
and an empty queue built through the name threads vLLM's ``KVCacheBlock`` (kvqueue's
own default is ``kvqueue.KVCacheBlock``). Queues built through the name get the
``on_misuse`` policy given to :func:`install`. Pools built after :func:`install` use
kvqueue; pools built before keep the queue they have.

Before it patches anything, :func:`install` checks the installed vLLM: its
version must be one whose own test suites kvqueue runs (0.33), its
``KVCacheBlock`` must have exactly the known fields with ``__slots__`` links,
and every public method of vLLM's queue must exist on kvqueue's. Anything else
raises :class:`VLLMLayoutError` and leaves vLLM untouched.

Importing this module does not import vLLM; :func:`install` does.

vLLM's plugin entry point (group ``vllm.general_plugins``, name ``kvqueue``) is
:func:`plugin`: vLLM calls it in every process it starts, and it installs only when
``KVQUEUE_VLLM`` asks (``1``/``auto``, ``cython``, ``python``); the queues' policy is
``KVQUEUE_ON_MISUSE``. ``VLLM_PLUGINS``, when set, must name ``kvqueue`` (vLLM decides).

It patches the calling process. vLLM's engine core, where the block pool lives, runs in a
child process by default: a forked child (vLLM's default start method) inherits the patch;
a spawned one does not, so there call :func:`install` in the child too, or keep the engine
core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Literal

from . import _env, _policy, _pool_guard, _vllm_lines
from ._block import check_block_type
from ._pool_guard import pool_repairs

__all__ = (
    "ENV",
    "KNOWN_VERSIONS",
    "POOL_GUARD_ENV",
    "WRAP_FOREIGN_ENV",
    "VLLMLayoutError",
    "check",
    "install",
    "installed",
    "installed_policy",
    "patched",
    "plugin",
    "plugin_settings",
    "pool_repairs",
    "status",
    "uninstall",
)

Implementation = Literal["auto", "cython", "python"]

#: The vLLM minor versions whose own test suites pass with kvqueue installed (vllm_tests/):
#: only what is tested is accepted; ``install(check_version=False)`` tries another.
KNOWN_VERSIONS: tuple[tuple[int, int], ...] = ((0, 33),)

#: ``dataclasses.fields(vllm.v1.core.kv_cache_utils.KVCacheBlock)``, in order.
KNOWN_BLOCK_FIELDS: tuple[str, ...] = (
    "block_id",
    "ref_cnt",
    "pool",
    "_block_hash",
    "_block_hash_num_tokens",
    "prev_free_block",
    "next_free_block",
    "is_null",
)

#: The variable that turns :func:`plugin` on, and names the implementation.
ENV = _env.VLLM
#: ``0`` turns the pool guard off (the plugin reads it; install() takes ``pool_guard``).
POOL_GUARD_ENV = _env.POOL_GUARD
#: ``1``: the plugin installs over another project's patch (install()'s ``wrap_foreign``).
WRAP_FOREIGN_ENV = _env.WRAP_FOREIGN
_PLUGIN_CHOICES: dict[str, Implementation | None] = {
    "0": None,
    "1": "auto",
    "auto": "auto",
    "cython": "cython",
    "python": "python",
}

_UTILS = "vllm.v1.core.kv_cache_utils"
_POOL = "vllm.v1.core.block_pool"
_NAME = "FreeKVCacheBlockQueue"


class VLLMLayoutError(RuntimeError):
    """The installed vLLM is not one kvqueue knows how to patch; nothing was changed."""


class _QueueName(type):
    """The metaclass of what vLLM's ``FreeKVCacheBlockQueue`` name is bound to by install().

    A class rather than a function, so that ``isinstance(queue, FreeKVCacheBlockQueue)``
    and attribute look-ups (``FreeKVCacheBlockQueue.popleft``) in vLLM's code keep working.
    """

    queue_class: type
    block_type: type
    on_misuse: _policy.MisusePolicy | None

    def __call__(
        cls,
        blocks: Any,
        *,
        block_type: type | None = None,
        on_misuse: _policy.MisusePolicy | None = None,
    ) -> Any:
        """kvqueue's queue of ``blocks``; O(len(blocks)). Raises as its constructor does."""
        if block_type is None:
            if not isinstance(blocks, (list, tuple)):
                blocks = list(blocks)
            if not blocks:
                block_type = cls.block_type
        if on_misuse is None:
            on_misuse = cls.on_misuse
        return cls.queue_class(blocks, block_type=block_type, on_misuse=on_misuse)

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, cls.queue_class)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, cls.queue_class)

    def __getattr__(cls, name: str) -> Any:
        return getattr(cls.queue_class, name)


def _queue_name(
    queue_class: type, block_type: type, on_misuse: _policy.MisusePolicy | None
) -> _QueueName:
    namespace = {
        "__module__": __name__,
        "__qualname__": _NAME,
        "__doc__": f"Builds {queue_class.__module__}.{queue_class.__qualname__} for vLLM.",
        "queue_class": queue_class,
        "block_type": block_type,
        "on_misuse": on_misuse,
        "__kvqueue_standin__": True,
    }
    return _QueueName(_NAME, (), namespace)


@dataclasses.dataclass
class _Installed:
    implementation: str
    queue_class: type
    on_misuse: _policy.MisusePolicy | None
    # What vLLM's FreeKVCacheBlockQueue name is bound to now, and vLLM's own class.
    bound: _QueueName
    original: type
    # vLLM's BlockPool methods the guard replaced (empty with the guard off).
    pool_class: type
    pool_originals: dict[str, Any]
    wrap_foreign: bool


# The state lives in vLLM's module, beside the name it patched: a reloaded
# kvqueue.vllm (a new module-global namespace) still finds it there.
_STATE = "__kvqueue_installed__"
_logger = logging.getLogger("kvqueue")
_lock = threading.RLock()


def _state() -> _Installed | None:
    utils = sys.modules.get(_UTILS)
    return getattr(utils, _STATE, None) if utils is not None else None


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
    ``BlockPool``'s methods as they are. Calling it again is a no-op, or switches the
    implementation, the policy or the guard.
    ``check_version=False`` skips the version check only; the block layout is always checked.
    ``wrap_foreign=True`` accepts a queue class or pool method that another project
    patched: the guard wraps that pool method, and kvqueue's queue replaces that queue
    (a warning names what is replaced).

    Raises :class:`VLLMLayoutError` on a vLLM it does not know, or one another project
    patched (unless ``wrap_foreign``); ``ImportError`` when vLLM (or the requested
    implementation) cannot be imported; ValueError for an unknown ``implementation`` or
    ``on_misuse``. On any error nothing is changed.
    """
    if on_misuse is not None:
        on_misuse = _policy.resolve(on_misuse)
    queue_class, name = _queue_class(implementation)
    screen = _screen_module(name)
    with _lock:
        state = _state()
        if state is None:
            state = _checked(check_version, wrap_foreign, queue_class, name, on_misuse)
            # Guard first: it may still refuse, and then nothing has changed.
            if pool_guard:
                state.pool_originals = _guard(state.pool_class, screen, wrap_foreign)
            setattr(sys.modules[_UTILS], _STATE, state)
            _rebind(state.bound, state.original)
        else:
            state.wrap_foreign = state.wrap_foreign or wrap_foreign
            if state.implementation != name or bool(state.pool_originals) != pool_guard:
                # From guard to guard in one assignment per method (guard() replaces its
                # own), never through vLLM's method: no call in between goes unguarded.
                if pool_guard:
                    state.pool_originals = _guard(state.pool_class, screen, state.wrap_foreign)
                else:
                    _pool_guard.unguard(state.pool_class, state.pool_originals)
                    state.pool_originals = {}
            if state.queue_class is not queue_class or state.on_misuse != on_misuse:
                state.bound = _queue_name(queue_class, state.bound.block_type, on_misuse)
                _rebind(state.bound)
                state.queue_class, state.implementation = queue_class, name
                state.on_misuse = on_misuse
        _forward_to_vllm_log(True)
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
    if check_version:
        _check_version(vllm)
    utils = importlib.import_module(_UTILS)
    original = getattr(utils, _NAME, None)
    if not isinstance(original, type):
        raise VLLMLayoutError(f"{_UTILS} defines no {_NAME} class")
    block_class = getattr(utils, "KVCacheBlock", None)
    _check_block_class(block_class)
    _check_queue_api(original, queue_class)
    # Importing the pool binds its own name to vLLM's class; that is the one used.
    pool = importlib.import_module(_POOL)
    pool_class = getattr(pool, "BlockPool", None)
    if not isinstance(pool_class, type):
        raise VLLMLayoutError(f"{_POOL} defines no BlockPool class")
    foreign = _foreign_queue(original, getattr(pool, _NAME, None))
    if foreign and not wrap_foreign:
        raise VLLMLayoutError(
            f"{foreign}; kvqueue would bypass that patch. install(wrap_foreign=True) "
            "(KVQUEUE_WRAP_FOREIGN=1) replaces it with kvqueue's queue anyway"
        )
    if foreign:
        _logger.warning("kvqueue: %s; kvqueue's queue replaces it (wrap_foreign)", foreign)
    assert isinstance(block_class, type)
    bound = _queue_name(queue_class, block_class, on_misuse)
    return _Installed(name, queue_class, on_misuse, bound, original, pool_class, {}, wrap_foreign)


def _foreign_queue(original: type, pool_name: object) -> str | None:
    """What another project changed in vLLM's queue class, if anything."""
    if pool_name is not original:
        return f"{_POOL}.{_NAME} is not {_UTILS}.{_NAME}: {_describe(pool_name)} replaced it"
    if original.__module__ != _UTILS:
        return f"{_UTILS}.{_NAME} is not vLLM's own: {_describe(original)} replaced it"
    for attribute, value in vars(original).items():
        module = getattr(value, "__module__", _UTILS)
        if callable(value) and module != _UTILS:
            return f"{_UTILS}.{_NAME}.{attribute} is not vLLM's own: {_describe(value)} replaced it"
    return None


def _describe(obj: object) -> str:
    module = getattr(obj, "__module__", None) or "an unknown module"
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{name}"


def _guard(pool_class: type, screen: ModuleType, wrap_foreign: bool) -> dict[str, Any]:
    try:
        line = _vllm_lines.find(getattr(sys.modules.get("vllm"), "__version__", ""))
        return _pool_guard.guard(
            pool_class,
            screen,
            _pool_policy,
            wrap_foreign=wrap_foreign,
            line=line or _vllm_lines.LINES[-1],
        )
    except _pool_guard.ForeignPatch as exc:
        raise _foreign_method(exc) from None


def _foreign_method(exc: _pool_guard.ForeignPatch) -> VLLMLayoutError:
    return VLLMLayoutError(
        f"{exc}; kvqueue would bypass or double that patch. install(wrap_foreign=True) "
        "(KVQUEUE_WRAP_FOREIGN=1) has kvqueue's guard wrap it"
    )


def _pool_policy(pool: Any) -> _policy.MisusePolicy:
    """A pool guard's policy: its queue's, else install()'s (or the environment's)."""
    policy = getattr(pool.free_block_queue, "on_misuse", None)
    if policy in ("raise", "repair"):
        return _policy.resolve(policy)
    state = _state()
    return _policy.resolve(state.on_misuse if state is not None else None)


def _rebind(bound: Any, original: Any = None) -> None:
    """Bind vLLM's name to ``bound`` in every loaded ``vllm.*`` module that holds vLLM's
    class or a kvqueue stand-in, whenever it was imported; None puts vLLM's class back."""
    for key, module in list(sys.modules.items()):
        if not (key == "vllm" or key.startswith("vllm.")) or module is None:
            continue
        value = getattr(module, _NAME, None)
        if value is None:
            continue
        if getattr(value, "__kvqueue_standin__", False) or (
            original is not None and value is original
        ):
            setattr(module, _NAME, bound)


def uninstall() -> bool:
    """Give vLLM its own queue and pool methods back; False if kvqueue was not installed.

    Every ``vllm.*`` module whose name holds a kvqueue stand-in gets vLLM's class back,
    whenever it was imported. A name or method that someone else rebound after
    :func:`install` is left as they set it. Pools built while kvqueue was installed keep
    their kvqueue queues.
    """
    with _lock:
        state = _state()
        if state is None:
            return False
        _pool_guard.unguard(state.pool_class, state.pool_originals)
        _rebind(state.original)
        delattr(sys.modules[_UTILS], _STATE)
        _forward_to_vllm_log(False)
        return True


def installed() -> str | None:
    """The implementation installed into vLLM (``"cython"`` or ``"python"``), or None."""
    state = _state()
    return None if state is None else state.implementation


def installed_policy() -> _policy.MisusePolicy | None:
    """The ``on_misuse`` given to :func:`install`; None: the environment decides, or none."""
    state = _state()
    return None if state is None else state.on_misuse


def status() -> dict[str, Any]:
    """What is installed into vLLM in this process, for logs and bug reports.

    ``implementation``: ``"cython"``, ``"python"`` or None (not installed); ``on_misuse``:
    the policy given to :func:`install` (None: ``KVQUEUE_ON_MISUSE`` decides per queue);
    ``pool_guard``: whether ``BlockPool``'s methods are guarded, and ``guarded``: which.
    """
    state = _state()
    return {
        "implementation": None if state is None else state.implementation,
        "on_misuse": None if state is None else state.on_misuse,
        "pool_guard": bool(state is not None and state.pool_originals),
        "guarded": [] if state is None else sorted(state.pool_originals),
    }


@contextmanager
def patched(
    implementation: Implementation = "auto",
    *,
    on_misuse: _policy.MisusePolicy | None = None,
    pool_guard: bool = True,
) -> Iterator[type]:
    """``with kvqueue.vllm.patched():`` install for the block only (as it was after)."""
    was = _state()
    before = None if was is None else (was.implementation, was.on_misuse, bool(was.pool_originals))
    queue_class = install(implementation, on_misuse=on_misuse, pool_guard=pool_guard)
    try:
        yield queue_class
    finally:
        if before is None:
            uninstall()
        else:
            install(
                _as_implementation(before[0]),
                check_version=False,
                on_misuse=before[1],
                pool_guard=before[2],
            )


def check(implementation: Implementation = "auto", *, wrap_foreign: bool = False) -> None:
    """Raise what :func:`install` would raise on this vLLM, changing nothing.

    A no-op when kvqueue is installed already (that install was checked).
    """
    queue_class, name = _queue_class(implementation)
    with _lock:
        if _state() is not None:
            return
        state = _checked(True, wrap_foreign, queue_class, name, None)
        try:
            _pool_guard.originals(state.pool_class, wrap_foreign=wrap_foreign)
        except _pool_guard.ForeignPatch as exc:
            raise _foreign_method(exc) from None


def plugin_settings() -> dict[str, Any] | None:
    """What :func:`plugin` would install, read from the environment; None: nothing.

    Keys: ``implementation``, ``on_misuse`` (None: each queue reads ``KVQUEUE_ON_MISUSE``,
    or an application's own :func:`install` policy stays), ``pool_guard``, ``wrap_foreign``.
    Raises ValueError, naming the variable and its values, for a value none of them takes.
    """
    implementation = _env.choice(ENV, _PLUGIN_CHOICES, None)
    if implementation is None:
        return None
    policy = _policy.resolve(None) if os.environ.get(_policy.ENV) else installed_policy()
    return {
        "implementation": implementation,
        "on_misuse": policy,
        "pool_guard": _env.flag(POOL_GUARD_ENV, default=True),
        "wrap_foreign": _env.flag(WRAP_FOREIGN_ENV),
    }


def plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: :func:`install` if ``KVQUEUE_VLLM`` says so.

    Unset, empty or ``0``: does nothing (not even import vLLM). ``1`` or ``auto``, ``cython``,
    ``python``: installs that implementation, with the policy ``KVQUEUE_ON_MISUSE`` names
    (read now, to fail at startup rather than at the first queue; unset keeps a policy an
    application gave :func:`install` itself), the pool guard unless ``KVQUEUE_POOL_GUARD=0``,
    and ``wrap_foreign`` if ``KVQUEUE_WRAP_FOREIGN=1`` (:func:`plugin_settings`). Logs one
    line in vLLM's log when it activates. Safe to call again: a repeated call with the same
    settings changes nothing.

    Raises ValueError for another value of any of these variables, and whatever
    :func:`install` raises: asked for kvqueue, vLLM does not start without it.
    """
    settings = plugin_settings()
    if settings is None:
        return
    before = status()
    install(**settings)
    after = status()
    if after != before:
        import kvqueue

        _logger.info(
            "kvqueue %s active: vLLM's free block queue is kvqueue's %s twin, pool guard %s, "
            "on_misuse=%s",
            kvqueue.__version__,
            after["implementation"],
            "on (" + ", ".join(after["guarded"]) + ")" if after["pool_guard"] else "off",
            after["on_misuse"] or _policy.resolve(None),
        )


class _ToVLLMLog(logging.Handler):
    """Hands kvqueue's records to vLLM's handler: its stream, format, time and process."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm")
        if target.handlers:
            target.handle(record)
        else:
            # Before vLLM configures its logging (or with VLLM_CONFIGURE_LOGGING=0):
            # what Python does for a logger without handlers.
            last = logging.lastResort
            if not logging.getLogger().handlers and last and record.levelno >= last.level:
                last.handle(record)


def _forward_to_vllm_log(on: bool) -> None:
    handlers = [h for h in _logger.handlers if type(h).__name__ == _ToVLLMLog.__name__]
    if on and not handlers:
        _logger.addHandler(_ToVLLMLog())
        # The active line is INFO: let it through unless the application set a level.
        if _logger.level == logging.NOTSET:
            _logger.setLevel(logging.INFO)
    elif not on:
        for handler in handlers:
            _logger.removeHandler(handler)


def _as_implementation(name: str) -> Implementation:
    return "cython" if name == "cython" else "python"


def _queue_class(implementation: str) -> tuple[type, str]:
    if implementation == "auto":
        import kvqueue

        return kvqueue.FreeKVCacheBlockQueue, kvqueue.IMPLEMENTATION
    if implementation == "cython":
        try:
            from ._queue import FreeKVCacheBlockQueue as compiled
        except ImportError as exc:
            raise ImportError(
                f"kvqueue's compiled queue is not available ({exc}); "
                "use install('python') or install('auto')"
            ) from exc
        return compiled, "cython"
    if implementation == "python":
        from ._queue_py import FreeKVCacheBlockQueue as pure

        return pure, "python"
    raise ValueError(f"implementation must be 'auto', 'cython' or 'python', not {implementation!r}")


def _screen_module(implementation: str) -> ModuleType:
    if implementation == "cython":
        from . import _screen

        return _screen
    from . import _screen_py

    return _screen_py


def _parse_version(text: str) -> tuple[int, int] | None:
    parts = text.split(".")
    if len(parts) < 2:
        return None
    minor = ""
    for char in parts[1]:
        if not char.isdigit():
            break
        minor += char
    if not parts[0].isdigit() or not minor:
        return None
    return int(parts[0]), int(minor)


def _check_version(vllm: ModuleType) -> None:
    version = getattr(vllm, "__version__", None)
    if not isinstance(version, str):
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("vllm")
        except Exception as exc:
            raise VLLMLayoutError(
                "cannot tell the installed vLLM's version (no vllm.__version__); "
                "install(check_version=False) skips this check"
            ) from exc
    if _parse_version(version) not in KNOWN_VERSIONS:
        known = ", ".join(f"{major}.{minor}" for major, minor in KNOWN_VERSIONS)
        raise VLLMLayoutError(
            f"kvqueue.vllm knows the block layout of vLLM {known}, not of vLLM {version}: "
            "only the vLLM versions whose own tests pass with kvqueue are accepted; "
            "install(check_version=False) skips the version check (the block class's "
            "fields are still checked)"
        )


def _check_block_class(block_class: object) -> None:
    if not isinstance(block_class, type) or not dataclasses.is_dataclass(block_class):
        raise VLLMLayoutError(f"{_UTILS}.KVCacheBlock is not a dataclass: {block_class!r}")
    fields = tuple(f.name for f in dataclasses.fields(block_class))
    if fields != KNOWN_BLOCK_FIELDS:
        raise VLLMLayoutError(
            f"{_UTILS}.KVCacheBlock has fields {fields}, not the known {KNOWN_BLOCK_FIELDS}"
        )
    try:
        check_block_type(block_class)
    except TypeError as exc:
        raise VLLMLayoutError(f"{_UTILS}.KVCacheBlock: {exc}") from exc


def _check_queue_api(original: type, queue_class: type) -> None:
    missing = sorted(
        name
        for name in vars(original)
        if not name.startswith("_") and not hasattr(queue_class, name)
    )
    if missing:
        raise VLLMLayoutError(f"vLLM's {_NAME} has methods kvqueue's lacks: {', '.join(missing)}")
