"""kvqueue's log: the ``kvqueue`` logger, and its records handed to vLLM's log while installed."""

from __future__ import annotations

import logging

__all__ = ("forward_to_vllm", "logger")

logger = logging.getLogger("kvqueue")


class _ToVLLMLog(logging.Handler):
    """Hands kvqueue's records to vLLM's handler: its stream, format, time and process."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm")
        if target.handlers:
            # vLLM's format prints the file name: name the package too, so that a line of
            # kvqueue's (`[kvqueue/vllm.py:42]`) does not read as one of vLLM's own files.
            record = logging.makeLogRecord(record.__dict__)
            record.filename = f"kvqueue/{record.filename}"
            target.handle(record)
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
