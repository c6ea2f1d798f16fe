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
version must be one whose block layout is known (0.30 to 0.33), its
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

from . import _policy
from ._block import check_block_type

__all__ = (
    "ENV",
    "KNOWN_VERSIONS",
    "VLLMLayoutError",
    "install",
    "installed",
    "installed_policy",
    "patched",
    "plugin",
    "uninstall",
)

Implementation = Literal["auto", "cython", "python"]

#: The vLLM minor versions whose ``KVCacheBlock`` / ``BlockPool`` layout kvqueue knows
#: (0.30 and 0.33 were checked against their source; the field check below guards any other).
KNOWN_VERSIONS: tuple[tuple[int, int], ...] = ((0, 30), (0, 31), (0, 32), (0, 33))

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
ENV = "KVQUEUE_VLLM"
_PLUGIN_CHOICES: dict[str, Implementation] = {
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
    }
    return _QueueName(_NAME, (), namespace)


@dataclasses.dataclass
class _Installed:
    implementation: str
    queue_class: type
    on_misuse: _policy.MisusePolicy | None
    # What the modules' FreeKVCacheBlockQueue name is bound to now.
    bound: _QueueName
    # Every (module, original value) whose FreeKVCacheBlockQueue name was rebound.
    originals: list[tuple[ModuleType, Any]]


_logger = logging.getLogger("kvqueue")
_lock = threading.RLock()
_state: _Installed | None = None


def install(
    implementation: Implementation = "auto",
    *,
    check_version: bool = True,
    on_misuse: _policy.MisusePolicy | None = None,
) -> type:
    """Make vLLM's block pools use kvqueue's ``FreeKVCacheBlockQueue``; return that class.

    ``implementation`` is ``"auto"`` (whatever ``import kvqueue`` picked), ``"cython"`` or
    ``"python"``. ``on_misuse`` (``"raise"``, ``"repair"`` or None) is passed to every
    queue built through vLLM's name, unless the caller passes its own; None leaves the
    choice to ``KVQUEUE_ON_MISUSE``, read when each queue is built. Calling it again is a
    no-op, or switches the implementation and the policy.
    ``check_version=False`` skips the version check only; the block layout is always checked.

    Raises :class:`VLLMLayoutError` on a vLLM it does not know, ``ImportError`` when vLLM
    (or the requested implementation) cannot be imported, ValueError for an unknown
    ``implementation`` or ``on_misuse``.
    """
    global _state
    if on_misuse is not None:
        on_misuse = _policy.resolve(on_misuse)
    queue_class, name = _queue_class(implementation)
    with _lock:
        if _state is not None:
            if _state.queue_class is queue_class and _state.on_misuse == on_misuse:
                return queue_class
            bound = _queue_name(queue_class, _state.bound.block_type, on_misuse)
            for module, _original in _state.originals:
                if getattr(module, _NAME, None) is _state.bound:
                    setattr(module, _NAME, bound)
            _state.queue_class = queue_class
            _state.implementation = name
            _state.on_misuse = on_misuse
            _state.bound = bound
            return queue_class

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
        if getattr(pool, _NAME, None) is not original:
            raise VLLMLayoutError(
                f"{_POOL}.{_NAME} is not {_UTILS}.{_NAME} "
                f"(found {getattr(pool, _NAME, None)!r}): was it patched by someone else?"
            )
        modules = [utils, pool]
        modules += [
            module
            for key, module in list(sys.modules.items())
            if key.startswith("vllm.")
            and module is not None
            and module is not utils
            and module is not pool
            and getattr(module, _NAME, None) is original
        ]
        originals = [(module, original) for module in modules]
        assert isinstance(block_class, type)
        bound = _queue_name(queue_class, block_class, on_misuse)
        for module in modules:
            setattr(module, _NAME, bound)
        _state = _Installed(name, queue_class, on_misuse, bound, originals)
        return queue_class


def uninstall() -> bool:
    """Give vLLM its own queue back; False if kvqueue was not installed.

    A name that someone else rebound after :func:`install` is left as they set it.
    Pools built while kvqueue was installed keep their kvqueue queues.
    """
    global _state
    with _lock:
        if _state is None:
            return False
        for module, original in _state.originals:
            if getattr(module, _NAME, None) is _state.bound:
                setattr(module, _NAME, original)
        _state = None
        return True


def installed() -> str | None:
    """The implementation installed into vLLM (``"cython"`` or ``"python"``), or None."""
    with _lock:
        return None if _state is None else _state.implementation


def installed_policy() -> _policy.MisusePolicy | None:
    """The ``on_misuse`` given to :func:`install`; None: the environment decides, or none."""
    with _lock:
        return None if _state is None else _state.on_misuse


@contextmanager
def patched(
    implementation: Implementation = "auto", *, on_misuse: _policy.MisusePolicy | None = None
) -> Iterator[type]:
    """``with kvqueue.vllm.patched():`` install for the block only (if not installed before)."""
    was, was_policy = installed(), installed_policy()
    queue_class = install(implementation, on_misuse=on_misuse)
    try:
        yield queue_class
    finally:
        if was is None:
            uninstall()
        else:
            install(_as_implementation(was), check_version=False, on_misuse=was_policy)


def plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: :func:`install` if ``KVQUEUE_VLLM`` says so.

    Unset, empty or ``0``: does nothing (not even import vLLM). ``1`` or ``auto``, ``cython``,
    ``python``: installs that implementation, with the policy ``KVQUEUE_ON_MISUSE`` names
    (read now, to fail at startup rather than at the first queue). Safe to call again: a
    repeated call with the same settings changes nothing.

    Raises ValueError for another value of either variable, and whatever :func:`install`
    raises: asked for kvqueue, vLLM does not start without it.
    """
    choice = os.environ.get(ENV, "").strip().lower()
    if choice in ("", "0"):
        return
    if choice not in _PLUGIN_CHOICES:
        raise ValueError(
            f"{ENV} must be one of {', '.join(sorted(_PLUGIN_CHOICES))} (or unset, 0), "
            f"not {os.environ[ENV]!r}"
        )
    policy = _policy.resolve(None) if os.environ.get(_policy.ENV) else None
    was = installed()
    install(_PLUGIN_CHOICES[choice], on_misuse=policy)
    if was != installed():
        _logger.info("kvqueue: vLLM's free block queue is kvqueue's (%s)", installed())


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
            f"kvqueue.vllm knows the block layout of vLLM {known}, not of vLLM {version}; "
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
