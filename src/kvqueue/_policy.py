"""What a queue does on misuse, shared by both twins: raise, or repair and report.

``"raise"`` (the default) refuses a misused call whole and leaves the queue as
it was. ``"repair"`` applies the one safe repair that some misuses have (skip
a block that is linked already, a duplicate, a sentinel; ignore the removal of
a block that is not in the queue), links the rest of the call, counts the
repair on the queue and logs it on the ``kvqueue`` logger.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Literal

from . import _core, _env

__all__ = ("ENV", "KINDS", "MisusePolicy", "admit", "report", "resolve", "unlogged_note", "warn")

MisusePolicy = Literal["raise", "repair"]

#: The environment variable read when a queue is built with ``on_misuse=None``
#: (kvqueue.vllm reads it by this name).
ENV = _env.MISUSE_POLICY

_POLICIES: dict[str, MisusePolicy] = {"raise": "raise", "repair": "repair"}

#: The repairs, by kind, with what each one did (the log line says it).
KINDS: dict[str, str] = {
    "duplicate": "it appears more than once in the batch; linked once",
    "linked": "it is already linked into a free list; left where it is",
    "sentinel": "it is a sentinel of this queue; left where it is",
    "not_linked": "it is not linked; nothing removed",
    "other_pool": "it belongs to another pool's queue; left where it is",
}

logger = logging.getLogger("kvqueue")

# At most _BURST log records per _WINDOW seconds, per process: a double-free
# bug in an engine's hot loop repairs thousands of times a second, and each
# repair is counted on its queue whether or not it is logged.
_WINDOW = 60.0
_BURST = 10
_window_start = float("-inf")
_logged = 0
_unlogged = 0


def resolve(on_misuse: object) -> MisusePolicy:
    """The policy that ``on_misuse`` names; ``None`` reads :data:`ENV` now.

    Raises ValueError for anything but ``"raise"``, ``"repair"`` or None (an
    unset or empty variable means ``"raise"``).
    """
    if on_misuse is None:
        return _env.choice(ENV, _POLICIES, "raise")
    if on_misuse == "raise" and type(on_misuse) is str:
        return "raise"
    if on_misuse == "repair" and type(on_misuse) is str:
        return "repair"
    raise ValueError(f"on_misuse must be 'raise', 'repair' or None, not {on_misuse!r:.80}")


def admit() -> int | None:
    """Whether a repair may be logged now (the rate limit): None if not, else how many
    repairs went unlogged since the last line that was."""
    global _window_start, _logged, _unlogged
    now = time.monotonic()
    if now - _window_start >= _WINDOW:
        _window_start = now
        _logged = 0
    if _logged >= _BURST:
        _unlogged += 1
        return None
    _logged += 1
    unlogged, _unlogged = _unlogged, 0
    return unlogged


def unlogged_note(unlogged: int) -> str:
    return f" ({unlogged} earlier repairs were not logged)" if unlogged else ""


def warn(message: str, *args: object) -> None:
    """``logger.warning(message, *args)``, never raising: a repair is logged after it is
    made, and a handler or filter that raises must not make the repaired call look
    failed (its caller would retry or give up a call that succeeded)."""
    with contextlib.suppress(Exception):
        logger.warning(message, *args)


def report(method: str, block: object, kind: str, count: int) -> None:
    """Log one repair (rate-limited): ``count`` is the queue's total of ``kind``."""
    unlogged = admit()
    if unlogged is None:
        return
    warn(
        "%s() repaired a misuse (%s #%d on this queue): skipped %s: %s%s",
        method,
        kind,
        count,
        _core.describe(block),
        KINDS[kind],
        unlogged_note(unlogged),
    )
