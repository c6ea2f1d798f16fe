"""What the pool guard and its rules report: the repairs counted per pool, the findings of
the holder audit counted per process, the log lines, and where a call came from; and the
repairs kvqueue's queues make, in any pool, which the queue's floor tells here (``_log``).

Shared by the guard (``_pool_guard``), its rules (``_rules``) and the holder audit
(``_audit``), which all report here and read nothing back but the counts.
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

from .. import _log, _policy, _render
from . import _registry

__all__ = (
    "TALLY",
    "audit_findings",
    "audited_steps",
    "call",
    "caller",
    "count_finding",
    "count_queue_repair",
    "count_rebuild",
    "count_refusal",
    "count_repair",
    "events",
    "freed",
    "frees_made",
    "index_rebuilds",
    "last_freed",
    "log_notes",
    "named",
    "pool_repairs",
    "recent_frees",
    "repaired",
    "then_log",
    "where",
)

# Per pool, weakly: a pool's counters go with it.
_repairs: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
# The holder audit's findings in this process, by kind, whatever the policy did with them.
_findings: dict[str, int] = dict.fromkeys(_policy.AUDIT_MISUSES, 0)
#: What the holder audit reads and moves at every step, one list (a step starts with these out of
#: the processor's cache, and each object read costs a wait): the steps it audited in this
#: process, and the guarded frees whose releases no holder index checked, made in it.
TALLY = [0, 0]
# Every refusal (under "raise") and repair of the guard and its audit in this process, every
# finding of the audit, every repair of a queue (outcome "queue_repaired") and every rebuild of
# a stale holder index (``_REBUILT``), by (outcome, method, kind); each count is handed to the
# one watcher (kvqueue's metrics, ``_metrics``) as it moves.
_events: dict[tuple[str, str, str], int] = {}
_watcher: list[Callable[[str, str, str, int], None]] = []
_REBUILT = ("rebuilt", _registry.AUDIT_HOOK, "index_stale")

# The last frees the guard passed that no holder index checked, newest last: (the blocks, the
# caller's code and the byte offset of its call). The audit names the one that last released a
# block it finds shared; a step frees far fewer batches than this. A free the index checked is
# not kept: it is named as it is made whenever it is a fault the index can see, and keeping it
# would cost its caller's frame object (made only when asked: 2 µs of a free in a scheduler
# step) and, once it leaves the ring, a write to each of its blocks, long out of the cache.
_FREES = 4096
_frees: collections.deque[tuple[list[Any], Any, int]] = collections.deque(maxlen=_FREES)
# Their blocks (a pool without an index, HiSparse's unpins): what the audit reads between its
# full reads. A free the index checked left no block it released listed and free, or
# under-counted.
_unchecked: collections.deque[list[Any]] = collections.deque(maxlen=_FREES)
# kvqueue's own: the guard, its rules, the audit, this module and the queue's pure twin calling
# its gate, the frames between a checked call and the code that made it.
_PACKAGE = os.path.dirname(os.path.dirname(__file__)) + os.sep
# From freed: the free guard's two frames (_pool_guard's adapter and free rule), then its caller.
_FREE_DEPTH = 3


def pool_repairs(pool: object) -> dict[str, int]:
    """The repairs the guard made on ``pool``, by kind (all 0 for a pool it never repaired)."""
    return dict(_repairs.get(pool) or dict.fromkeys(_policy.POOL_MISUSES, 0))


def audit_findings() -> dict[str, int]:
    """What the holder audit found in this process, by kind, raised or repaired."""
    return dict(_findings)


def audited_steps() -> int:
    """How many scheduler steps the holder audit read in this process."""
    return TALLY[0]


def count_rebuild() -> int:
    """Count a rebuild of a stale holder index; this process's count of them."""
    return _event(*_REBUILT)


def index_rebuilds() -> int:
    """How many times a full read found the holder index stale in this process."""
    return _events.get(_REBUILT, 0)


def count_finding(kind: _policy.AuditMisuse) -> None:
    _findings[kind] += 1
    _event("found", _registry.AUDIT_HOOK, kind)


def count_refusal(method: str, kind: str) -> None:
    """Count a misuse of ``kind`` that ``method``'s guard (or the audit's) is about to raise."""
    _event("refused", method, kind)


def count_queue_repair(method: str, kind: _policy.QueueMisuse) -> None:
    """Count a repair of ``kind`` that a queue's ``method`` made."""
    _event("queue_repaired", method, kind)


_log.on_queue_repair(count_queue_repair)


def events() -> dict[tuple[str, str, str], int]:
    """This process's refusals, repairs and findings, by (outcome, method, kind)."""
    return dict(_events)


def watch(watcher: Callable[[str, str, str, int], None] | None) -> None:
    """Hand every count that moves from now on to ``watcher`` (None: to no one)."""
    _watcher[:] = [] if watcher is None else [watcher]


def _event(outcome: str, method: str, kind: str) -> int:
    """Count one event; its count in this process."""
    key = (outcome, method, kind)
    count = _events[key] = _events.get(key, 0) + 1
    for watcher in _watcher:
        watcher(outcome, method, kind, count)
    return count


# A repair to log: (message arguments). Logged once vLLM's method has run, so that
# a logging handler that calls back into the pool finds it whole.
Note = tuple[Any, ...]


def repaired(
    pool: Any, method: str, block: Any, kind: _policy.PoolMisuse, notes: list[Note]
) -> int:
    """Count a repair of ``kind`` on ``pool``, and note its log line; the pool's count of it."""
    count = count_repair(pool, kind, method)
    notes.append((call(method), kind, count, named(block), _policy.REPAIRED[kind], pool))
    return count


def count_repair(pool: Any, kind: _policy.PoolMisuse, method: str) -> int:
    """Count a repair of ``kind`` by ``method``'s guard on ``pool``; the pool's count of it."""
    counts = _repairs.get(pool)
    if counts is None:
        counts = _repairs[pool] = dict.fromkeys(_policy.POOL_MISUSES, 0)
    counts[kind] += 1
    _event("repaired", method, kind)
    return counts[kind]


def then_log(notes: list[Note], original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """vLLM's method, then the repairs' log lines (even if it raised)."""
    try:
        return original(*args, **kwargs)
    finally:
        log_notes(notes)


def log_notes(notes: list[Note]) -> None:
    for *note, pool in notes:
        _log.repaired(
            "%s repaired a double free (%s #%d on this pool): block %s: %s. %s",
            *note,
            where(pool),
        )


def freed(blocks: list[Any], depth: int = _FREE_DEPTH) -> None:
    """Keep a guarded free of ``blocks`` that no holder index checked, with its caller, for
    :func:`last_freed` and :func:`recent_frees`. Called by the free guard, and by the check of a
    release that lets a manager's free through: the ``depth - 1`` frames above this one are
    theirs (kvqueue's frames above those are passed over too). O(kvqueue's frames)."""
    # The walk starts at the guard's caller: each frame object caller() would step through is
    # made on the way (the interpreter makes them only when asked), a cost at every free.
    try:
        frame = _outside(sys._getframe(depth))
    except ValueError:  # the guard's caller is no Python code
        frame = None
    if frame is None:  # no Python code called it (a thread's target)
        _frees.append((blocks, None, 0))
    else:
        # Its place, not its line: a line is found by a walk of the code's line table, which
        # only a message needs (_line).
        _frees.append((blocks, frame.f_code, frame.f_lasti))
    _unchecked.append(blocks)
    TALLY[1] += 1


def frees_made() -> int:
    """How many guarded frees this process made that no holder index checked: the audit
    keeps its place by it."""
    return TALLY[1]


def recent_frees(n: int) -> list[list[Any]] | None:
    """The blocks of the last ``n`` guarded frees no holder index checked, newest first, or
    None if fewer are kept; O(n): read from the newest end, not past the older ones."""
    if n > len(_unchecked):
        return None
    return list(itertools.islice(reversed(_unchecked), n))


def last_freed(block: object) -> str | None:
    """Where the last guarded free of ``block`` that no holder index checked, and that is still
    kept, was called, or None."""
    for blocks, code, place in reversed(_frees):
        if any(found is block for found in blocks):
            if code is None:
                return "unknown"
            return _site(code.co_filename, _line(code, place), code.co_name)
    return None


def _line(code: Any, place: int) -> int:
    """The line of the instruction at byte ``place`` of ``code`` (as ``f_lineno`` has it)."""
    for start, end, line in code.co_lines():
        if start <= place < end and line is not None:
            return int(line)
    return int(code.co_firstlineno)


def named(block: Any) -> str:
    """A block for a message: its ``block_id`` from its slot, else as ``describe`` has it;
    no code of the block's runs."""
    found = _render.block_id(block)
    return _render.describe(block) if found is None else _render.number(found)


def call(method: str) -> str:
    return f"BlockPool.{method}()"


def where(pool: Any) -> str:
    """Which pool, and the caller of the guarded method (the code that misused it)."""
    frame = caller()
    site = "unknown"
    if frame is not None:
        site = _site(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
    blocks = getattr(pool, "num_gpu_blocks", "?")
    return f"Pool: BlockPool at {id(pool):#x} ({blocks} blocks); called from {site}"


def caller() -> Any:
    """The code that called the guarded method: the first frame outside kvqueue's guard
    (None: the stack holds no other). Walked, not counted: how many of kvqueue's frames lie
    between differs by method, rule and line."""
    return _outside(sys._getframe(1))


def _outside(frame: Any) -> Any:
    """``frame``, or the first frame it was called from outside kvqueue's code."""
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    return frame


def _site(filename: str, line: int, function: str) -> str:
    # An installed package by its import path (vllm/v1/core/...), else the file's tail.
    path = filename.replace("\\", "/")
    path = path.rpartition("-packages/")[2] or path
    return f"{'/'.join(path.split('/')[-4:])}:{line} in {function}"
