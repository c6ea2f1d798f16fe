"""vLLM's real BlockPool, driven by a seeded serving trace: kvqueue changes nothing.

    python bench/engine_check.py                    # vLLM 0.33.0 and 0.30.0, both twins
    python bench/engine_check.py --versions 0.33.0  # one wheel only

The pool and its helpers are exec'd from the published wheel (bench/engine_pool.py; the
first use of a version fetches its wheel, see bench/vllm_source.py), and kvqueue goes in
through ``kvqueue.vllm.patched()``, as ``install()`` would in a real engine. With vLLM's own
queue and with each twin, every step must hand out the same block ids, evict the same
cached blocks and leave the same number of free blocks. The shipped traces are shrunk to a
second or so each. ``make bench-engine`` runs this before timing anything.

Exit status 1, naming the version, trace and twin, on the first difference (or when the
trace no longer reaches every queue operation the pool uses). The compiled twin must be
importable: a missing build is a failure, not a skip.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter
from typing import Any

import engine_pool
import engine_trace

import kvqueue.vllm as kv_vllm

# kvqueue.vllm knows vLLM 0.30 to 0.33: both ends, with their own block pools.
VERSIONS = ("0.33.0", "0.30.0")
TWINS: tuple[kv_vllm.Implementation, ...] = ("cython", "python")


class Mismatch(AssertionError):
    """A twin's run differs from vLLM's own queue's, or the trace misses an operation."""


def _small(params: engine_trace.TraceParams) -> engine_trace.TraceParams:
    # A small pool and short outputs keep requests finishing and eviction busy.
    low, high = params.output_tokens
    return dataclasses.replace(
        params,
        num_blocks=params.num_blocks // 8,
        steps=params.steps // 5,
        warmup_steps=0,
        output_tokens=(min(low, 32), min(high, 256)),
    )


def _run(engine: engine_pool.Engine, trace: engine_trace.Trace) -> tuple[Any, Any]:
    params = trace.params
    pool = engine.BlockPool(
        params.num_blocks, enable_caching=True, hash_block_size=params.block_size
    )
    scheduler = engine_trace.Scheduler(trace, pool, record=True)
    scheduler.run(params.steps)
    return scheduler, pool


def _final_state(pool: Any) -> tuple[Any, ...]:
    return (
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        sorted(pool.cached_block_hash_to_block._cache),
    )


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise Mismatch(what)


def check_coverage(engine: engine_pool.Engine, trace: engine_trace.Trace, stats: Any) -> None:
    """The trace reaches every queue operation the pool uses, and eviction."""
    for key in ("evicted", "prefix_hit_blocks", "finished"):
        _expect(stats[key] > 0, f"the trace never reaches {key!r}: {stats}")
    log = engine_trace.QueueLog(engine.vllm_queue)
    engine.use_queue(log)
    try:
        params = trace.params
        pool = engine.BlockPool(params.num_blocks, enable_caching=True, hash_block_size=16)
        engine_trace.Scheduler(trace, pool).run(params.steps)
    finally:
        engine.use_queue(engine.vllm_queue)
    calls = Counter(op for op, _ in log.ops)
    needed = ["popleft_n", "prepend_n", "append_n"]
    if trace.params.name == "prefix-heavy":
        needed.append("remove")
    for op in needed:
        _expect(calls[op] > 0, f"the trace never calls {op}: {calls}")
    sizes = {n for op, n in log.ops if op == "popleft_n"}
    _expect(1 in sizes and max(sizes) > 1, f"popleft_n needs n == 1 and n > 1: {sorted(sizes)}")


def check_twin(
    engine: engine_pool.Engine,
    trace: engine_trace.Trace,
    twin: kv_vllm.Implementation,
    reference: tuple[Any, Any],
) -> None:
    """The same steps, block for block, with ``twin`` installed into vLLM."""
    expected_scheduler, expected_state = reference
    engine.use_queue(engine.vllm_queue)
    with engine.in_sys_modules(), kv_vllm.patched(twin) as queue_class:
        _expect(engine.queue_in_use() is queue_class, "install() did not reach the pool")
        scheduler, pool = _run(engine, trace)
    # The pool's blocks are vLLM's own, unchanged.
    _expect(type(pool.free_block_queue) is queue_class, "the pool built another queue")
    _expect(pool.free_block_queue.block_type is engine.KVCacheBlock, "not vLLM's block type")
    _expect(engine.queue_in_use() is engine.vllm_queue, "patched() did not restore vLLM's queue")
    _expect(scheduler.stats == expected_scheduler.stats, f"stats: {scheduler.stats}")
    for step, (got, want) in enumerate(zip(scheduler.log, expected_scheduler.log, strict=True)):
        _expect(got == want, f"step {step}: {got} != {want}")
    _expect(_final_state(pool) == expected_state, "the final pool state differs")


def check_version(version: str, twins: tuple[kv_vllm.Implementation, ...]) -> None:
    engine = engine_pool.load_engine(version)
    for name in ("decode-heavy", "prefix-heavy"):
        trace = engine_trace.make_trace(_small(engine_trace.TRACES[name]), engine)
        _expect(kv_vllm.installed() is None, "kvqueue is already installed into vLLM")
        engine.use_queue(engine.vllm_queue)
        reference = _run(engine, trace)
        _expect(type(reference[1].free_block_queue) is engine.vllm_queue, "not vLLM's queue")
        reference_state = (reference[0], _final_state(reference[1]))
        check_coverage(engine, trace, reference[0].stats)
        for twin in twins:
            try:
                check_twin(engine, trace, twin, reference_state)
            except Mismatch as exc:
                raise Mismatch(f"vllm {version}, {name}, {twin} twin: {exc}") from None
            print(f"engine_check: vllm {version} {name} {twin}: same steps", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="+", default=list(VERSIONS), choices=VERSIONS)
    parser.add_argument("--twins", nargs="+", default=list(TWINS), choices=TWINS)
    args = parser.parse_args(argv)
    try:
        for version in args.versions:
            check_version(version, tuple(args.twins))
    except Mismatch as exc:
        print(f"engine_check: FAIL: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
