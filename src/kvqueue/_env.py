"""The environment variables kvqueue reads, each with a closed set of values.

A value outside its variable's set is refused with a ValueError that names the
variable and what it takes: a typo (``KVQUEUE_PURE=false``, ``" 0"``) must not
quietly select the opposite of what was meant. Unset and empty mean the default.
Imports nothing of kvqueue but to word a refusal: ``setup.py`` loads this file on its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TypeVar

__all__ = (
    "AUDIT_EVERY",
    "FLAG",
    "MEANINGS",
    "METRICS_DIR",
    "MISUSE_POLICY",
    "POOL_GUARD",
    "PURE",
    "USER",
    "VLLM",
    "WRAP_FOREIGN",
    "audit_every",
    "choice",
    "flag",
)

T = TypeVar("T")

# The variables' names; what each does is written once, in MEANINGS. setup.py reads PURE too
# (KVQUEUE_PURE=1 builds a pure wheel).
PURE = "KVQUEUE_PURE"
MISUSE_POLICY = "KVQUEUE_ON_MISUSE"
VLLM = "KVQUEUE_VLLM"
POOL_GUARD = "KVQUEUE_POOL_GUARD"
WRAP_FOREIGN = "KVQUEUE_WRAP_FOREIGN"
AUDIT_EVERY = "KVQUEUE_AUDIT_EVERY"
#: Not a user's: the directory kvqueue's plugin makes in vLLM's front-end process for its
#: metrics, inherited by the processes vLLM starts (``kvqueue.vllm._metrics``).
METRICS_DIR = "KVQUEUE_METRICS_DIR"

#: Every variable a user sets, in the order ``python -m kvqueue`` and the README list them,
#: with what it does (the README's table of settings is checked against these).
MEANINGS: Mapping[str, str] = {
    VLLM: "1, cython or python: the vLLM plugin installs kvqueue (a vLLM it does not accept "
    "does not start); auto: installs, or stays off with a warning; 0 or unset: off",
    MISUSE_POLICY: "raise (default) or repair: the misuse policy of queues and pool guards",
    POOL_GUARD: "0: the vLLM plugin leaves BlockPool's methods unguarded (1 or unset: guarded)",
    AUDIT_EVERY: "1, 2, 4, ... 1024: steps between the holder audit's full reads of every "
    "listing, which check the holder index too (0 or unset: none; each step looks up only the "
    "blocks freed since unchecked by the index, in it)",
    WRAP_FOREIGN: "1: the vLLM plugin installs over another project's patch (0 or unset: refuses)",
    PURE: "1: import kvqueue loads the pure twin (0 or unset: the compiled one)",
}
USER = tuple(MEANINGS)

#: The values of KVQUEUE_AUDIT_EVERY, and its default.
EVERY: Mapping[str, int] = {"0": 0, **{str(1 << k): 1 << k for k in range(11)}}
# None by default: a full read costs what the cache lists (tens of milliseconds a step at
# 100,000 listings), a stall the holder index makes needless (bench/README.md).
EVERY_DEFAULT = 0

#: The values of an on/off variable.
FLAG: Mapping[str, bool] = {"1": True, "0": False}


def choice(name: str, values: Mapping[str, T], default: T) -> T:
    """The value that variable ``name`` selects from ``values``; ``default`` if it is
    unset or empty. Raises ValueError for anything else, listing ``values``."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        return values[raw]
    except KeyError:
        # Short wherever it is shown (a traceback, vLLM's stderr, python -m kvqueue): a long
        # set by its ends, a long value cut.
        keys = [repr(key) for key in values]
        accepted = ", ".join(keys if len(keys) <= 5 else [*keys[:3], "...", keys[-1]])
        raise _refused(f"{name} must be one of {accepted} (or unset), not {_cut(raw)}") from None


def _cut(raw: str) -> str:
    """The repr of ``raw``'s first characters: at most 16, and 40 columns (an escape such as
    ``\\x01`` takes four). O(1)."""
    shown = raw[:16]
    while len(repr(shown)) > 40:
        shown = shown[:-1]
    return repr(shown)


def _refused(problem: str) -> ValueError:
    """The ValueError that says ``problem``: kvqueue's, in lines that fit as a traceback prints
    them (``_errors.bad_value``); plain where ``setup.py`` loads this file outside kvqueue."""
    if not __package__:
        return ValueError(problem)
    from . import _errors

    return _errors.bad_value(problem)


def flag(name: str, default: bool = False) -> bool:
    """Variable ``name`` as a switch: ``1`` on, ``0`` off, unset or empty ``default``."""
    return choice(name, FLAG, default)


def audit_every() -> int:
    """The steps between the holder audit's full reads that KVQUEUE_AUDIT_EVERY names now
    (0: none). Raises ValueError for a value it does not take."""
    return choice(AUDIT_EVERY, EVERY, EVERY_DEFAULT)
