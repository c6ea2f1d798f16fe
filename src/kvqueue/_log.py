"""kvqueue's log: the ``kvqueue`` logger, its rate limit, the one function that logs a repair
(for the queues and the pool guard alike), who else hears of a queue's repairs, and the
forwarding to vLLM's log while installed."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from . import _policy, _render

__all__ = ("forward_to_vllm", "logger", "on_queue_repair", "queue_repaired", "repaired")

logger = logging.getLogger("kvqueue")


class _Wrapped(logging.Filter):
    """Every record of kvqueue's in lines of at most 100 columns, whatever its values (a
    block, a pool, a caller's path), before any handler formats it; never raises: a repair
    is logged after it is made (see :func:`repaired`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        with contextlib.suppress(Exception):
            text = record.getMessage()
            wrapped = _render.wrap(text)
            if wrapped is not text:
                record.msg, record.args = wrapped, None
        return True


logger.addFilter(_Wrapped())

# At most _BURST log records per _WINDOW seconds, per process: a double-free
# bug in an engine's hot loop repairs thousands of times a second, and each
# repair is counted on its queue or pool whether or not it is logged.
_WINDOW = 60.0
_BURST = 10
_window_start = float("-inf")
_logged = 0
_unlogged = 0
# Told of every repair a queue makes, logged or not (kvqueue.vllm counts them for its metrics:
# the queue's floor cannot import it, so it subscribes here).
_listeners: list[Callable[[str, _policy.QueueMisuse], None]] = []


def _admit() -> int | None:
    """Whether a repair may be logged now: None if not, else how many repairs went
    unlogged since the last line that was."""
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


def repaired(message: str, *args: object) -> None:
    """Log one repair at WARNING under the rate limit, never raising: a repair is logged
    after it is made, and a handler or filter that raises must not make the repaired call
    look failed (its caller would retry or give up a call that succeeded)."""
    unlogged = _admit()
    if unlogged is None:
        return
    note = f" ({unlogged} earlier repairs were not logged)" if unlogged else ""
    with contextlib.suppress(Exception):
        logger.warning(message + "%s", *args, note)


def on_queue_repair(listener: Callable[[str, _policy.QueueMisuse], None]) -> None:
    """Call ``listener(method, kind)`` for every repair a queue makes from now on (once,
    however often it is given)."""
    if listener not in _listeners:
        _listeners.append(listener)


def queue_repaired(method: str, block: object, kind: _policy.QueueMisuse, count: int) -> None:
    """A queue's repair of ``kind`` (``count``: the queue's total of it) on ``block``: told to
    every listener, then logged. Never raises, as :func:`repaired`."""
    for listener in _listeners:
        with contextlib.suppress(Exception):
            listener(method, kind)
    repaired(
        "%s() repaired a misuse (%s #%d on this queue): skipped %s: %s",
        method,
        kind,
        count,
        _render.describe(block),
        _policy.REPAIRED[kind],
    )


class _ToVLLMLog(logging.Handler):
    """Hands kvqueue's records to vLLM's handler: its stream, format, time and process."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm")
        if target.handlers:
            # vLLM's format prints the file name: name the package too, so that a line of
            # kvqueue's (`[kvqueue/vllm/__init__.py:42]`) does not read as one of vLLM's own files.
            record = logging.makeLogRecord(record.__dict__)
            record.filename = f"kvqueue/{record.filename}"
            # vLLM's handlers only, less any the record reached already through the
            # "kvqueue" logger's own propagation (a handler on the root, as pytest's).
            seen = logging.getLogger().handlers if logger.propagate else []
            for handler in target.handlers:
                if handler not in seen and record.levelno >= handler.level:
                    handler.handle(record)
        else:
            # Before vLLM configures its logging (or with VLLM_CONFIGURE_LOGGING=0):
            # what Python does for a logger without handlers.
            last = logging.lastResort
            if not logging.getLogger().handlers and last and record.levelno >= last.level:
                last.handle(record)


_handler = _ToVLLMLog()


def forward_to_vllm(on: bool) -> None:
    """Start or stop handing the ``kvqueue`` logger's records to vLLM's log."""
    if on and _handler not in logger.handlers:
        logger.addHandler(_handler)
        # The active line is INFO: let it through unless the application set a level.
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    elif not on:
        logger.removeHandler(_handler)
