"""What the fuzz programs share: the entry point, outcomes, and link checks.

A fuzz program runs in its own interpreter (``python -m isolated.fuzz_X TWIN SEED OPS``,
``helpers.run_isolated``) so that a crash kills its own process and fails one test, not
the test run. It prints one JSON line of counters on success.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

Outcome = tuple[Any, ...]
Stats = dict[str, int]


def main(program: Callable[[str, int, int], Stats]) -> None:
    name, seed, ops = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    stats = program(name, seed, ops)
    print(json.dumps(stats, sort_keys=True))


def outcome(call: Callable[[], Any]) -> Outcome:
    """What a call did, comparable across twins: block ids, or the exception."""
    try:
        result = call()
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))
    return ("returned", ids(result))


def ids(value: Any) -> Any:
    if isinstance(value, list):
        return [ids(v) for v in value]
    return getattr(value, "block_id", value)


def well_formed(queue: Any, limit: int = 100_000) -> str | None:
    """Why the queue's free list is not well formed, or None if it is.

    Runs with the collector off: a finalizer that calls into the queue must
    not move it while it is being walked.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
        if head.prev_free_block is not None or tail.next_free_block is not None:
            return "a sentinel has an outer link"
        seen = {id(head)}
        curr = head
        for _ in range(limit):
            nxt = curr.next_free_block
            if nxt is None or nxt.prev_free_block is not curr:
                return f"broken link after {ids(curr)}"
            if nxt is tail:
                if len(seen) - 1 != queue.num_free_blocks:
                    return f"{len(seen) - 1} blocks but num_free_blocks={queue.num_free_blocks}"
                return None
            if id(nxt) in seen:
                return "a cycle"
            seen.add(id(nxt))
            curr = nxt
        return "too long"
    finally:
        if enabled:
            gc.enable()


def detached(blocks: Iterable[Any]) -> bool:
    return all(b.prev_free_block is None and b.next_free_block is None for b in blocks)
