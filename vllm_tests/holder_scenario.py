"""A block held by two requests, on vLLM's own ``Scheduler``: what each contender does.

Run by ``test_holder_audit.py`` in its own process, from the root of the installed line's
own test files (``sdist.tests_root``), whose ``tests/v1/core/utils.py`` builds the scheduler
(``create_scheduler(enable_prefix_caching=True, num_blocks=40)``) and the requests, as vLLM's
scheduler tests do. Prints one JSON object: per form, contender and policy, what happened.

The forms, each a free that releases a reference a live request still holds:

* ``shared``: requests A and B share a cached prefix block (``ref_cnt`` 2); a connector-like
  caller frees it once more in a call of its own (2 -> 1, legal at that moment); A is aborted
  (1 -> 0: queued free while B lists it); C asks for every free block and is scheduled.
* ``single``: a connector frees a running request's only reference to its first block; C
  asks for every free block.
* ``unguarded``: a running request's only reference to its last block released by no
  guarded free (``ref_cnt`` lowered, the block queued and put at the free list's front by
  hand); C asks for every free block but one.
* ``queued_held``: as ``unguarded``, the block queued with its reference (``ref_cnt`` left
  as it is).
* ``after_audit``: as ``unguarded``, the release a guarded free made by a callback of the
  step C is scheduled in, after that step's audit.

A step that raised is started once more, as a caller that catches the error would. Then B
(or the running request) is aborted and the scheduler steps once more: C is served.
After every step the pool is checked: its count against its free list, and which blocks
two live requests list.
"""

from __future__ import annotations

import inspect
import json
import sys
import warnings
from typing import Any

warnings.simplefilter("ignore")

import no_triton  # noqa: E402
from tests.v1.core.utils import create_requests, create_scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

import kvqueue.vllm  # noqa: E402

BLOCK = 16
ABORTED = RequestStatus.FINISHED_ABORTED


def listed(scheduler: Any) -> dict[str, list[int]]:
    """Each live request's block ids, over every manager."""
    tables: dict[str, list[int]] = {}
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        for request, blocks in manager.req_to_blocks.items():
            tables.setdefault(request, []).extend(b.block_id for b in blocks if not b.is_null)
    return tables


def over_held(scheduler: Any) -> list[int]:
    """The blocks more live requests list than hold a reference (two holders, one count)."""
    pool = scheduler.kv_cache_manager.block_pool
    holders: dict[int, int] = {}
    for ids in listed(scheduler).values():
        for block_id in ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    return sorted(b for b, n in holders.items() if n > pool.blocks[b].ref_cnt)


def pool_state(scheduler: Any) -> dict[str, Any]:
    pool = scheduler.kv_cache_manager.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    return {
        "count_is_list": pool.get_num_free_blocks() == len(free),
        "over_held": over_held(scheduler),
    }


def to_front(queue: Any, block: Any) -> None:
    """``block``, linked in ``queue``, made its first, with the methods every line's queue has
    (before 0.23 a queue has no front insertion, and a free queues at the back)."""
    if queue.fake_free_list_head.next_free_block is block:
        return
    # A move within the free list, not a release: past kvqueue's entry check.
    gate = getattr(queue, "gate", None)
    if gate is not None:
        queue.gate = None
    try:
        behind = [each for each in queue.get_all_free_blocks() if each is not block]
        for each in [block, *behind]:
            queue.remove(each)
        queue.append(block)
        queue.append_n(behind)
    finally:
        if gate is not None:
            queue.gate = gate


def step(scheduler: Any, states: list[dict[str, Any]]) -> Any:
    try:
        return scheduler.schedule()
    finally:
        states.append(pool_state(scheduler))


def run(form: str) -> dict[str, Any]:
    scheduler = create_scheduler(enable_prefix_caching=True, num_blocks=40)
    pool = scheduler.kv_cache_manager.block_pool
    takes = inspect.signature(pool.free_blocks).parameters
    first = {"prepend": True} if "prepend" in takes else {}
    states: list[dict[str, Any]] = []
    a, b = create_requests(2, num_tokens=2 * BLOCK + 8, same_prompt=True, req_ids=["A", "B"])
    scheduler.add_request(a)
    step(scheduler, states)
    holder = "A"
    if form == "shared":
        scheduler.add_request(b)
        step(scheduler, states)
        holder = "B"
    table = listed(scheduler)
    # Met at the free list's exit, the block is the holder's partial last one, which a free
    # queues first; C then asks for one block fewer than are free, so that the block's
    # repair leaves it every block it was counted.
    exit_form = form in ("unguarded", "after_audit", "queued_held")
    if exit_form:
        victim = table[holder][-1]
    else:
        victim = next(i for i in table[holder] if form == "single" or i in table["A"])
    block = pool.blocks[victim]
    refs_before = block.ref_cnt
    result: dict[str, Any] = {"block": victim, "holder": holder, "refs_before": refs_before}
    if form in ("unguarded", "queued_held"):
        # Returned the way some connectors and downstream pools do: the count lowered by
        # hand, or left as it is (the block queued with its reference).
        block.ref_cnt -= form == "unguarded"
        try:
            pool.free_block_queue.append(block)
        except Exception as exc:
            result["refused"] = f"{type(exc).__name__}: {exc}"
            block.ref_cnt = refs_before  # refused, the caller keeps its reference
        if block.prev_free_block is not None:
            to_front(pool.free_block_queue, block)
    elif form == "after_audit":  # freed by a callback of the next step, after its audit
        manager = scheduler.kv_cache_manager
        start = manager.new_step_starts

        def new_step_starts() -> None:
            start()
            del manager.new_step_starts
            # Queued first, as each line queues a block it holds no hash for (vLLM 0.23
            # is told so; later lines do so themselves; earlier lines queue it last).
            pool.free_blocks([block], **first)
            if block.prev_free_block is not None:  # not left out by a repair
                to_front(pool.free_block_queue, block)

        manager.new_step_starts = new_step_starts
    else:
        try:
            pool.free_blocks([block])  # the connector-like caller's extra free
        except Exception as exc:
            result["refused"] = f"{type(exc).__name__}: {exc}"
    if form == "shared":
        scheduler.finish_requests("A", ABORTED)
    # The free of form after_audit is yet to come.
    wanted = pool.get_num_free_blocks() + (form == "after_audit") - exit_form
    (c,) = create_requests(3, num_tokens=wanted * BLOCK, req_ids=["x", "y", "C"])[2:]
    scheduler.add_request(c)
    try:
        step(scheduler, states)
    except Exception as exc:
        result["raised"] = f"{type(exc).__name__}: {exc}"
        # A caller that catches the error and starts the step again (an in-process engine,
        # a harness with retries) while the fault stands.
        try:
            step(scheduler, states)
        except Exception as again:
            result["retried"] = f"{type(again).__name__}: {again}"
    table = listed(scheduler)
    result["c_has_block"] = victim in table.get("C", [])
    result["holder_has_block"] = victim in table.get(holder, [])
    result["ref_cnt"] = block.ref_cnt
    result["in_free_list"] = block.prev_free_block is not None
    result["repairs"] = {k: v for k, v in kvqueue.vllm.pool_repairs(pool).items() if v}
    if "raised" not in result:
        scheduler.finish_requests(holder, ABORTED)
        step(scheduler, states)
        result["c_served"] = len(listed(scheduler).get("C", [])) == wanted
    result["states"] = states
    return result


def main() -> None:
    no_triton.allow()  # vLLM 0.34+ on an x86 CPU without triton-cpu: its config check only
    forms = sys.argv[1].split(",")
    results: dict[str, Any] = {}
    for contender in ("vllm", "cython", "python"):
        for policy in ("raise", "repair") if contender != "vllm" else ("-",):
            if contender == "vllm":
                kvqueue.vllm.uninstall()
            else:
                kvqueue.vllm.install(contender, on_misuse=policy)
            for form in forms:
                results[f"{form}/{contender}/{policy}"] = run(form)
    kvqueue.vllm.uninstall()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
