"""A targeted race: one thread links and pops fresh blocks (which only the queue
holds) while two others rewrite the same blocks' links from Python.

Python's own slot writes lock the block; the compiled queue reads and writes
the slots directly. Under a GIL the two cannot interleave inside a call; with
the GIL off they can, and a link released twice frees a block still in use.

Usage: python -m isolated.fuzz_race TWIN SEED OPS (OPS: link/pop rounds)
"""

from __future__ import annotations

import threading
from contextlib import suppress
from typing import Any

from kvqueue import KVCacheBlock

from support.fuzz_common import Stats, main
from support.twins import twin


def _scribble(queue: Any, stop: threading.Event) -> None:
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    while not stop.is_set():
        with suppress(Exception):
            block = tail.prev_free_block
            if block is not None and block is not head:
                block.prev_free_block = block.prev_free_block
                block.next_free_block = tail


def _round(queue: Any, block_id: int) -> int:
    """Link eight fresh blocks and pop them again; 1 if that raised."""
    try:
        queue.append_n([KVCacheBlock(block_id) for _ in range(8)])
        queue.popleft_n(8)
    except Exception:
        return 1
    return 0


def program(twin_name: str, seed: int, ops: int) -> Stats:
    queue = twin(twin_name).FreeKVCacheBlockQueue([])
    stop = threading.Event()
    scribblers = [threading.Thread(target=_scribble, args=(queue, stop)) for _ in range(2)]
    for thread in scribblers:
        thread.start()
    try:
        raised = sum(_round(queue, seed) for _ in range(ops))
    finally:
        stop.set()
        for thread in scribblers:
            thread.join()
    return {"ops": ops, "raised": raised}


if __name__ == "__main__":
    main(program)
