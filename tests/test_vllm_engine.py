"""vLLM's real BlockPool (0.33.0, and 0.30.0), driven by a seeded serving trace: kvqueue
changes nothing.

The pool and its helpers are exec'd from the published wheel (bench/engine_pool.py), and
kvqueue goes in through ``kvqueue.vllm.install()``, as it would in a real engine. With
vLLM's own queue and with each twin, every step must hand out the same block ids, evict
the same cached blocks and leave the same number of free blocks.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import kvqueue.vllm as kv_vllm

# kvqueue.vllm knows vLLM 0.30 to 0.33: both ends, with their own block pools.
VERSIONS = ("0.33.0", "0.30.0")
BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench_module(name: str) -> Any:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


@pytest.fixture(scope="module", params=VERSIONS, ids=lambda v: f"vllm-{v}")
def engine(request: pytest.FixtureRequest) -> Any:
    version = request.param
    vllm_source = _bench_module("vllm_source")
    try:
        vllm_source.vllm_file(version, "vllm/v1/core/block_pool.py")
    except Exception as exc:  # no network, no pip, no such release: nothing to test against
        pytest.skip(f"cannot fetch the vllm {version} wheel ({type(exc).__name__}: {exc})")
    return _bench_module("engine_pool").load_engine(version)


def _small(params: Any) -> Any:
    # The shipped traces, shrunk to a second or so each: a small pool and short outputs keep
    # requests finishing and eviction busy.
    low, high = params.output_tokens
    return dataclasses.replace(
        params,
        num_blocks=params.num_blocks // 8,
        steps=params.steps // 5,
        warmup_steps=0,
        output_tokens=(min(low, 32), min(high, 256)),
    )


TRACE_NAMES = ("decode-heavy", "prefix-heavy")


@pytest.fixture(scope="module", params=TRACE_NAMES)
def trace(request: pytest.FixtureRequest, engine: Any) -> Any:
    engine_trace = _bench_module("engine_trace")
    return engine_trace.make_trace(_small(engine_trace.TRACES[request.param]), engine)


def _run(engine: Any, trace: Any) -> tuple[Any, Any]:
    engine_trace = _bench_module("engine_trace")
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


@pytest.fixture(scope="module")
def reference(engine: Any, trace: Any) -> tuple[Any, Any]:
    assert kv_vllm.installed() is None
    engine.use_queue(engine.vllm_queue)
    scheduler, pool = _run(engine, trace)
    assert type(pool.free_block_queue) is engine.vllm_queue
    return scheduler, _final_state(pool)


def test_trace_exercises_the_pool(engine: Any, trace: Any, reference: tuple[Any, Any]) -> None:
    """The trace reaches every queue operation the pool uses, and eviction."""
    engine_trace = _bench_module("engine_trace")
    scheduler, _ = reference
    stats = scheduler.stats
    assert stats["evicted"] > 0
    assert stats["prefix_hit_blocks"] > 0
    assert stats["finished"] > 0
    log = engine_trace.QueueLog(engine.vllm_queue)
    engine.use_queue(log)
    try:
        params = trace.params
        pool = engine.BlockPool(params.num_blocks, enable_caching=True, hash_block_size=16)
        engine_trace.Scheduler(trace, pool).run(params.steps)
    finally:
        engine.use_queue(engine.vllm_queue)
    calls = Counter(op for op, _ in log.ops)
    for op in ("popleft_n", "prepend_n", "append_n"):
        assert calls[op] > 0, calls
    if trace.params.name == "prefix-heavy":
        assert calls["remove"] > 0, calls
    assert any(op == "popleft_n" and n == 1 for op, n in log.ops)
    assert any(op == "popleft_n" and n > 1 for op, n in log.ops)


def test_same_steps_through_install(
    engine: Any, trace: Any, reference: tuple[Any, Any], queue_mod: ModuleType
) -> None:
    implementation: kv_vllm.Implementation = (
        "cython" if queue_mod.__name__ == "kvqueue._queue" else "python"
    )
    expected_scheduler, expected_state = reference
    engine.use_queue(engine.vllm_queue)
    with engine.in_sys_modules(), kv_vllm.patched(implementation) as queue_class:
        assert queue_class is queue_mod.FreeKVCacheBlockQueue
        assert engine.queue_in_use() is queue_class
        scheduler, pool = _run(engine, trace)
    # The pool's blocks are vLLM's own, unchanged.
    assert type(pool.free_block_queue) is queue_class
    assert pool.free_block_queue.block_type is engine.KVCacheBlock
    assert engine.queue_in_use() is engine.vllm_queue
    assert scheduler.stats == expected_scheduler.stats
    # Step by step: block ids handed out, blocks evicted, free count, batch size.
    for got, want in zip(scheduler.log, expected_scheduler.log, strict=True):
        assert got == want
    assert _final_state(pool) == expected_state
