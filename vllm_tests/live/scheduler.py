"""vLLM's own scheduler, watched from inside the engine core: pool checks and injected double frees.

The driver names :class:`CheckedScheduler` in ``scheduler_cls``; vLLM builds it in the
engine-core process, where the ``BlockPool`` lives. It changes none of vLLM's block handling:

* after every ``schedule()`` and ``update_from_output()`` it checks the pool against the
  requests' block tables (the single full-attention manager's ``req_to_blocks``): each block's
  ``ref_cnt`` equals its number of holders, and the free list holds exactly the blocks nobody
  holds, as many as the pool counts; the first violations are written down;
* with ``_KVQUEUE_TEST_INJECT`` naming forms (``A``, ``B``, ``C``; ``AB``: both) it injects
  double frees. ``A`` and ``B`` go into vLLM's own freeing of a finished request
  (``_free_blocks``, in every line), so the faulty call is vLLM's ``BlockPool.free_blocks()``
  on the request's block list:

  - ``A`` (vLLM issue 42571): a block that request alone holds is in its list twice, so the
    one ``free_blocks()`` call gives it twice;
  - ``B``: a block that is already free (a finished request's prefix block, cached) is in the
    list of the next request that finishes, so it is freed again;

  the block is a request's first block: the next round's request of the same index hits it
  in the prefix cache. ``C`` is what such a double free leaves in a full pool: once a step has
  scheduled every block, a block that a running request holds (``ref_cnt`` 1) is linked into
  the free list, which then counts one free block, so the next allocation meets it.
  ``D`` releases a reference another holder still has: once a step has left a request
  running, a connector-like caller frees a running request's only reference to its last
  block (``BlockPool.free_blocks()`` of that one block, a call that adds up): the block is
  free while the request still lists it, and the next allocation can hand it to another.
  ``_KVQUEUE_TEST_INJECT_COUNT`` (default 1) bounds the injections of each form.

Everything it sees goes, one JSON object a line, to the journal ``_KVQUEUE_TEST_JOURNAL``
(appended and flushed at once, so it survives the engine core's death): the queue and guard
in use, each injection, each pool violation, kvqueue's log records, an exception leaving
the scheduler with the frame that raised it, and the pool's repair counters.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from collections import Counter
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.sched.scheduler import Scheduler

from live import INJECT, INJECT_COUNT, JOURNAL

#: The BlockPool methods that move reference counts or hand out blocks (unpin_blocks: 0.30+).
GUARDED = ("free_blocks", "touch", "get_new_blocks", "unpin_blocks")
#: Changes of the pool's violations written down; later ones are only counted.
DETAILED = 40
#: Form D waits for a step that leaves this many requests running.
RUNNING_FOR_D = 1


class Journal:
    """Appends JSON lines to a file, each flushed before the call returns."""

    def __init__(self, path: str | None) -> None:
        self.file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115

    def write(self, event: str, **fields: Any) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")
            self.file.flush()


class _ToJournal(logging.Handler):
    """kvqueue's log records (its repairs), as the engine core emits them."""

    def __init__(self, journal: Journal) -> None:
        super().__init__(logging.DEBUG)
        self.journal = journal

    def emit(self, record: logging.LogRecord) -> None:
        self.journal.write("log", level=record.levelname, message=record.getMessage())


def pool_evidence(pool: BlockPool) -> dict[str, Any]:
    """What this process's pool is built of: its queue's class, and kvqueue's own view."""
    import vllm

    import kvqueue.vllm

    status = kvqueue.vllm.status()
    return {
        "vllm": vllm.__version__,
        "queue": f"{type(pool.free_block_queue).__module__}.{type(pool.free_block_queue).__name__}",
        "on_misuse": getattr(pool.free_block_queue, "on_misuse", None),
        "installed": status["implementation"],
        "status": status,
        # Where the code of each pool method the guard covers comes from: vLLM's block_pool.py
        # unguarded (a wrapper may copy vLLM's names, never its code object).
        "methods": {
            name: _defined_in(getattr(type(pool), name))
            for name in GUARDED
            if hasattr(type(pool), name)
        },
        "num_blocks": pool.num_gpu_blocks,
    }


def _defined_in(function: Any) -> str:
    code = getattr(function, "__code__", None)
    return code.co_filename if code is not None else repr(function)


def pool_repairs(pool: BlockPool) -> dict[str, int]:
    import kvqueue.vllm

    return dict(kvqueue.vllm.pool_repairs(pool))


def violations(pool: BlockPool, tables: list[dict[str, list[Any]]]) -> list[str]:
    """How the pool disagrees with the block tables; [] when its accounting is exact. O(blocks)."""
    holders: Counter[int] = Counter()
    for table in tables:
        for blocks in table.values():
            holders.update(block.block_id for block in blocks if not block.is_null)
    queue = pool.free_block_queue
    linked: list[int] = []
    block = queue.fake_free_list_head.next_free_block
    # Bounded: a corrupt list may cycle.
    while block is not None and block is not queue.fake_free_list_tail:
        linked.append(block.block_id)
        if len(linked) > pool.num_gpu_blocks:
            break
        block = block.next_free_block
    found = []
    count = queue.num_free_blocks
    if count != len(linked):
        found.append(f"the pool counts {count} free blocks, its list links {len(linked)}")
    for block_id, times in Counter(linked).items():
        if times > 1:
            found.append(f"block {block_id} linked {times} times")
    linked_set = set(linked)
    for block in pool.blocks:
        if block.is_null:
            continue
        held = holders[block.block_id]
        if block.ref_cnt != held:
            found.append(f"block {block.block_id}: ref_cnt {block.ref_cnt}, {held} holders")
        if held and block.block_id in linked_set:
            found.append(f"block {block.block_id}: held by {held} and in the free list")
        # ref_cnt below 0: freed once too often, and no free list holds it (vLLM 0.23).
        if not held and block.ref_cnt <= 0 and block.block_id not in linked_set:
            found.append(f"block {block.block_id}: held by none, not in the free list (lost)")
    return found


def _raised_at(error: BaseException) -> str:
    """file:line function of the frame that raised ``error``."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"


class CheckedScheduler(Scheduler):
    """vLLM's scheduler with the pool checked after every step and double frees injected."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.journal = Journal(os.environ.get(JOURNAL))
        self.pool = self.kv_cache_manager.block_pool
        (self.manager,) = self.kv_cache_manager.coordinator.single_type_managers
        count = int(os.environ.get(INJECT_COUNT, "1"))
        # form -> injections still to make
        self.left = {form: count for form in os.environ.get(INJECT, "") if form in "ABCD"}
        self.stale: Any = None  # form B: a freed prefix block to free again
        self.steps = 0
        self.violating_steps = 0
        self.violations_written = 0
        self.last_found: list[str] = []
        self.repairs: dict[str, int] | None = None
        logging.getLogger("kvqueue").addHandler(_ToJournal(self.journal))
        evidence = pool_evidence(self.pool)
        # Repair counters are read only from a pool the guard watches.
        self.guarded = evidence["status"]["pool_guard"]
        self.journal.write("started", **evidence)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = self._watched(super().schedule, *args, **kwargs)
        self._check("schedule")
        if self.left.get("C") and self.pool.get_num_free_blocks() == 0:
            self._plant()
        if self.left.get("D") and len(self.running) >= RUNNING_FOR_D:
            self._watched(self._release)
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        outputs = self._watched(super().update_from_output, *args, **kwargs)
        self._check("update_from_output")
        return outputs

    def _watched(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        """``call``; an exception leaving it is written down (the engine core dies of it)."""
        try:
            return call(*args, **kwargs)
        except BaseException as error:
            self.journal.write(
                "died",
                step=self.steps,
                type=type(error).__name__,
                message=str(error),
                raised_at=_raised_at(error),
            )
            raise

    def _check(self, phase: str) -> None:
        self.steps += 1
        found = violations(self.pool, [self.manager.req_to_blocks])
        if found:
            self.violating_steps += 1
        # A violation is written when it changes, so the journal shows how the damage spreads.
        if found != self.last_found and self.violations_written < DETAILED:
            self.violations_written += 1
            self.journal.write(
                "violation",
                step=self.steps,
                phase=phase,
                found=found[:8],
                violating_steps=self.violating_steps,
            )
        self.last_found = found
        repairs = pool_repairs(self.pool) if self.guarded else None
        if repairs != self.repairs:
            self.repairs = repairs
            self.journal.write("repairs", step=self.steps, counters=repairs)

    def _free_blocks(self, request: Any) -> None:
        blocks = self.manager.req_to_blocks.get(request.request_id, [])
        injected = self._inject(request.request_id, blocks)
        try:
            super()._free_blocks(request)
        except ValueError as error:
            if injected is None:
                raise
            # kvqueue under "raise": the fault surfaced at vLLM's free of this request.
            self.journal.write(
                "refused",
                step=self.steps,
                block=injected,
                message=str(error),
                raised_at=_raised_at(error),
                # The request's blocks, popped from its table, are unfreed: still its own.
                pool_after=violations(self.pool, [self.manager.req_to_blocks, {"": blocks[:-1]}]),
            )
            raise
        first = blocks[0] if blocks else None
        if self.left.get("B") and self.stale is None and first is not None and first.ref_cnt == 0:
            self.stale = first

    def _inject(self, request_id: str, blocks: list[Any]) -> int | None:
        """Add a due double free to ``blocks`` (the request's table); the block's id, or None."""
        for form, left in self.left.items():
            if form in "CD":
                continue
            block = self._candidate(form, blocks) if left and blocks else None
            if block is None:
                continue
            blocks.append(block)
            self._injected(form, request_id, block)
            return int(block.block_id)
        return None

    def _plant(self) -> None:
        """Form C: a block a running request alone holds, linked into the empty free list."""
        for request_id, blocks in self.manager.req_to_blocks.items():
            block = next((b for b in blocks if not b.is_null and b.ref_cnt == 1), None)
            if block is None:
                continue
            self.pool.free_block_queue.append(block)
            self._injected("C", request_id, block)
            self._check("planted")  # the planted state, before anything meets it
            return

    def _injected(self, form: str, request_id: str, block: Any) -> None:
        """Count an injection of ``form`` and write it down, the block's state before it."""
        self.left[form] -= 1
        self.journal.write(
            "injected",
            form=form,
            step=self.steps,
            request=request_id,
            block=block.block_id,
            ref_cnt=block.ref_cnt,
            free_blocks=self.pool.get_num_free_blocks(),
        )

    def _release(self) -> None:
        """Form D: a running request's only reference to its last block, freed by another
        caller; the request still lists the block."""
        for request_id, blocks in self.manager.req_to_blocks.items():
            block = blocks[-1] if blocks else None
            if block is None or block.is_null or block.ref_cnt != 1:
                continue
            self._injected("D", request_id, block)
            self.pool.free_blocks([block])
            self._check("released")
            return

    def _candidate(self, form: str, blocks: list[Any]) -> Any:
        if form == "A":
            # The request's first block, when the request alone holds it.
            block = blocks[0]
            ok = not block.is_null and block.ref_cnt == 1 and block.block_hash is not None
            return block if ok else None
        # B: the first block of a request freed before, if it is still free.
        block, self.stale = self.stale, None
        return block if block is not None and block.ref_cnt == 0 else None
