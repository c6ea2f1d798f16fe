"""A queue is checked against a plain list before it is timed: a wrong queue is not benchmarked."""

from __future__ import annotations

import random
from typing import Any

from kvqueue import KVCacheBlock

POOL = 48
STEPS = 400


class WrongQueue(AssertionError):
    pass


def check(queue_class: type, seed: int = 0) -> None:
    """Random valid operations on ``queue_class`` and on a list, compared after each step."""
    rng = random.Random(seed)
    blocks = [KVCacheBlock(i) for i in range(POOL)]
    queue = queue_class(blocks)
    model = list(blocks)
    held: list[Any] = []
    _compare(queue, model, held, "construction")
    for step in range(STEPS):
        op = rng.choice(("popleft", "popleft_n", "append", "append_n", "prepend_n", "remove"))
        if op == "popleft" and model:
            got = [queue.popleft()]
            _same(got, model[:1], step, op)
            held += model[:1]
            del model[:1]
        elif op == "popleft_n":
            n = rng.randint(0, len(model))
            _same(queue.popleft_n(n), model[:n], step, op)
            held += model[:n]
            del model[:n]
        elif op == "append" and held:
            block = held.pop(rng.randrange(len(held)))
            queue.append(block)
            model.append(block)
        elif op in ("append_n", "prepend_n"):
            rng.shuffle(held)
            n = rng.randint(0, len(held))
            batch, held = held[:n], held[n:]
            getattr(queue, op)(batch)
            model[:] = model + batch if op == "append_n" else batch + model
        elif op == "remove" and model:
            block = model.pop(rng.randrange(len(model)))
            queue.remove(block)
            held.append(block)
        _compare(queue, model, held, f"step {step} ({op})")


def _compare(queue: Any, model: list[Any], held: list[Any], where: str) -> None:
    ids = [block.block_id for block in model]
    if queue.num_free_blocks != len(model):
        raise WrongQueue(f"{where}: num_free_blocks {queue.num_free_blocks} != {len(model)}")
    if [block.block_id for block in queue.get_all_free_blocks()] != ids:
        raise WrongQueue(f"{where}: get_all_free_blocks() differs from the model")
    if [block.block_id for block in queue.iter_blocks_after(None)] != ids:
        raise WrongQueue(f"{where}: iter_blocks_after(None) differs from the model")
    if model:
        cut = len(model) // 2
        after = [block.block_id for block in queue.iter_blocks_after(model[cut])]
        if after != ids[cut + 1 :]:
            raise WrongQueue(f"{where}: iter_blocks_after(cursor) differs from the model")
    if any(b.prev_free_block is not None or b.next_free_block is not None for b in held):
        raise WrongQueue(f"{where}: a block out of the queue still has links")


def _same(got: list[Any], want: list[Any], step: int, op: str) -> None:
    if [b.block_id for b in got] != [b.block_id for b in want]:
        raise WrongQueue(f"step {step}: {op} returned the wrong blocks")
