"""Misuse from several threads at once: the queue is not thread-safe, but no
interleaving of Python calls may crash the process.

Four threads share two queues and one set of blocks: they pop, link, remove
and move blocks between the queues, walk cursors, and assign the links
directly, with no lock. Exceptions (and wrong answers) are expected; a crash
is not. On a free-threaded CPython this is the test of whether the compiled
twin may declare itself free-threading compatible.

Usage: python -m isolated.fuzz_threads TWIN SEED OPS (OPS per thread)
"""

from __future__ import annotations

import random
import sys
import threading
from itertools import islice
from typing import Any

from kvqueue import KVCacheBlock

from support.fuzz_common import Stats, main
from support.twins import twin

THREADS = 4


def _worker(seed: int, ops: int, queues: list[Any], blocks: list[Any]) -> int:
    """Run ``ops`` random calls; how many raised."""
    rng = random.Random(seed)
    raised = 0
    for _ in range(ops):
        queue = rng.choice(queues)
        block = rng.choice(blocks)
        roll = rng.randrange(10)
        try:
            if roll == 0:
                queue.popleft()
            elif roll == 1:
                queue.popleft_n(rng.randint(0, 4))
            elif roll == 2:
                queue.append(block)
            elif roll == 3:
                rng.choice((queue.append_n, queue.prepend_n))(rng.sample(blocks, 3))
            elif roll == 4:
                queue.remove(block)
            elif roll == 5:
                list(islice(queue.iter_blocks_after(rng.choice((None, block))), 20))
            elif roll == 6:
                queue.get_all_free_blocks()
            elif roll == 7:
                # Misuse: links written behind the queue's back.
                setattr(block, rng.choice(("prev_free_block", "next_free_block")), None)
            elif roll == 8:
                block.next_free_block = rng.choice(blocks)
            else:
                len(queue), repr(queue)
        except Exception:
            raised += 1
    return raised


def program(twin_name: str, seed: int, ops: int) -> Stats:
    mod = twin(twin_name)
    # Switch threads often where there is a GIL, to interleave as much as it allows.
    sys.setswitchinterval(1e-6)
    blocks = [KVCacheBlock(i) for i in range(64)]
    queues = [mod.FreeKVCacheBlockQueue(blocks[:32]), mod.FreeKVCacheBlockQueue(blocks[32:])]
    raised = [0] * THREADS
    barrier = threading.Barrier(THREADS)

    def run(index: int) -> None:
        barrier.wait()
        raised[index] = _worker(seed * THREADS + index, ops, queues, blocks)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"ops": ops, "threads": THREADS, "raised": sum(raised), "gil": int(_gil_enabled())}


def _gil_enabled() -> bool:
    check = getattr(sys, "_is_gil_enabled", None)
    return True if check is None else bool(check())


if __name__ == "__main__":
    main(program)
