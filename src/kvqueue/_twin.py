"""The one choice of twin: which queue class ``import kvqueue`` and kvqueue.vllm use.

``import kvqueue`` makes the ``"auto"`` choice once (:func:`load`); ``kvqueue.vllm.install``
and ``python -m kvqueue`` read that choice (:func:`loaded`) or name a twin (:func:`named`),
so the reason a twin was chosen is worked out here only.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

from . import _env

__all__ = ("Twin", "load", "loaded", "named")


@dataclass(frozen=True)
class Twin:
    """``name``: ``"cython"`` or ``"python"``; ``queue``: its ``FreeKVCacheBlockQueue``;
    ``why``: the reason it was chosen, in words;
    ``failed``: why the compiled twin, wanted, could not be imported ("" if it was not)."""

    name: str
    queue: type
    why: str
    failed: str = ""


_loaded: Twin | None = None


def load(pure: bool) -> Twin:
    """The twin ``import kvqueue`` loads: the compiled one when it can, else the pure one."""
    global _loaded
    if pure:
        _loaded = _pure(f"{_env.PURE}=1")
    elif sys.implementation.name != "cpython":
        _loaded = _pure(f"{sys.implementation.name} runs the pure twin")
    else:
        try:
            _loaded = _compiled()
        except ImportError as exc:
            why = f"the compiled twin cannot be imported: {exc}"
            if not _installed(f"{__package__}._queue"):
                why = "this install has no compiled twin (built without a C compiler?)"
            _loaded = _pure(why, failed=str(exc))
        except RuntimeWarning:
            # A free-threaded CPython run with -W error refuses to re-enable the GIL for the
            # compiled twin; the pure one needs no GIL.
            _loaded = _pure("the compiled twin would re-enable the GIL (-W error)")
    return _loaded


def loaded() -> Twin:
    """The twin ``import kvqueue`` loaded."""
    assert _loaded is not None  # the package's __init__ loads one before any submodule runs
    return _loaded


def named(implementation: str) -> Twin:
    """``"auto"``: the twin ``import kvqueue`` loaded; ``"cython"`` or ``"python"``: that one.

    Raises ImportError for ``"cython"`` where the compiled twin is not available, and
    ValueError for any other name.
    """
    if implementation == "auto":
        return loaded()
    if implementation == "cython":
        try:
            return _compiled()
        except ImportError as exc:
            from . import _errors

            raise _errors.compiled_missing(exc) from exc
    if implementation == "python":
        return _pure("named")
    # At most 100 columns after "ValueError: ", as a traceback prints it.
    shown = f"{implementation!r:.30}"
    raise ValueError(f"implementation must be 'auto', 'cython' or 'python', not {shown}")


def _compiled() -> Twin:
    from ._queue import FreeKVCacheBlockQueue

    why = "the compiled twin (kvqueue._queue) imported"
    return Twin("cython", FreeKVCacheBlockQueue, why)


def _pure(why: str, *, failed: str = "") -> Twin:
    from ._queue_py import FreeKVCacheBlockQueue

    return Twin("python", FreeKVCacheBlockQueue, why, failed)


def _installed(name: str) -> bool:
    """Whether a module ``name`` is there to import (an import hook that refuses to look
    counts as there: its refusal is the reason given)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return True
