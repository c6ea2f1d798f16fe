"""kvqueue: vLLM's free KV-cache block queue, compiled.

``import kvqueue`` loads the compiled twin (``kvqueue._queue``) when it can,
else the pure-Python one (``kvqueue._queue_py``), as ``_twin`` decides; ``KVQUEUE_PURE=1``
forces the pure twin (``0`` or unset: the default; any other value is refused, see ``_env``).
``IMPLEMENTATION`` says which one is live.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from . import _env, _twin
from ._block import KVCacheBlock

__all__ = ("IMPLEMENTATION", "FreeKVCacheBlockQueue", "KVCacheBlock", "__version__")
__version__ = "0.1.0"


def _pure() -> bool:
    try:
        return _env.flag(_env.PURE)
    except ValueError:
        # `python -m kvqueue` imports this package first: it reports the bad value. So does
        # the plugin (its plan reads every variable), which vLLM's loader imports this
        # package for: raised here, vLLM would log it and start without kvqueue.
        from itertools import pairwise

        if ("-m", "kvqueue") not in pairwise(sys.orig_argv) and not _vllms_loader():
            raise
        return False


def _vllms_loader() -> bool:
    """Whether vLLM's plugin loader (``vllm.plugins.load_plugins_by_group``) imports this."""
    frame = sys._getframe(1)
    while frame is not None:
        if (
            frame.f_code.co_name == "load_plugins_by_group"
            and frame.f_globals.get("__name__") == "vllm.plugins"
        ):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


_chosen = _twin.load(_pure())
if _chosen.failed:
    # pip hides the build's own warning that the extension failed to compile: this is where
    # a user of such an install learns of it.
    import warnings

    warnings.warn(
        # A line each, each well within 100 columns after the importer's file and line.
        f"kvqueue: the compiled queue is not available ({_chosen.failed});\n"
        "using the pure-Python twin, whose calls are slower.\n"
        "Set KVQUEUE_PURE=1 to choose it and silence this.",
        RuntimeWarning,
        stacklevel=2,
    )
#: ``"cython"`` or ``"python"``: the twin ``import kvqueue`` loaded.
IMPLEMENTATION: str = _chosen.name
if TYPE_CHECKING:
    from ._queue_py import FreeKVCacheBlockQueue
else:
    FreeKVCacheBlockQueue = _chosen.queue
