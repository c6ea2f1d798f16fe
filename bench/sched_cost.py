"""The pool guard's own time per scheduler step, probed call by call (bench/scheduler.py).

A step-time difference is too noisy to show it. Each guarded ``BlockPool`` method gets an
*inner* ``perf_counter_ns`` shim around vLLM's own method, installed before
``kvqueue.vllm.install(twin, wrap_foreign=True)`` so that the guard wraps it, and an *outer*
one around what the pool's callers reach. Per call, gap = outer - inner time: the guard's own
work plus the shims' cost, which the same twin with the guard off gives alone, call for call
(the schedule is deterministic, and checked). Per call the median gap over ``reps`` runs;

    guard ns/step = (sum of median gaps, guard on - the same, guard off) / steps.

The null test, python's guard-off gaps less cython's, should be 0 (the queue twin runs outside
the gap). Method and its reasons: bench/README.md.
"""

from __future__ import annotations

import functools
import random
import time
from array import array
from statistics import median
from typing import Any

# What kvqueue's guard wraps (kvqueue._pool_guard.GUARDED), in that order.
GUARDED = ("get_new_blocks", "touch", "free_blocks", "unpin_blocks")


class Probe:
    """The two shims per guarded method, and what one run's calls recorded."""

    def __init__(self) -> None:
        self.method = array("b")  # index into GUARDED
        self.gap = array("q")  # outer - inner, ns
        self.size = array("q")  # blocks screened; -1: not a list (guard off)
        self._stack: list[list[int]] = []
        self.fingerprint = 0  # the run's schedule (sched_engine.Driver.fingerprint)

    def clear(self) -> None:
        del self.method[:], self.gap[:], self.size[:]

    def inner(self, original: Any) -> Any:
        clock, stack = time.perf_counter_ns, self._stack

        def timed(pool: Any, arg: Any, *args: Any, **kwargs: Any) -> Any:
            start = clock()
            result = original(pool, arg, *args, **kwargs)
            end = clock()
            slot = stack[-1]
            slot[0] = end - start
            slot[1] = arg if type(arg) is int else len(arg) if type(arg) is list else -1
            return result

        # vLLM's names (the guard reads the method's name for its messages).
        return functools.update_wrapper(timed, original)

    def outer(self, target: Any, index: int) -> Any:
        clock, stack = time.perf_counter_ns, self._stack
        method, gap, size = self.method, self.gap, self.size

        def timed(pool: Any, arg: Any, *args: Any, **kwargs: Any) -> Any:
            slot = [0, -1]
            stack.append(slot)
            start = clock()
            result = target(pool, arg, *args, **kwargs)
            end = clock()
            stack.pop()
            method.append(index)
            gap.append(end - start - slot[0])
            size.append(slot[1])
            return result

        return timed


def probed_run(factory: Any, specs: list[Any], w: Any, twin: str, guard: bool) -> Probe:
    """One run of ``w`` on ``twin``, the guard on or off, every guarded call probed."""
    import sched_engine
    from vllm.v1.core.block_pool import BlockPool

    import kvqueue.vllm

    kvqueue.vllm.uninstall()
    own = {m: BlockPool.__dict__[m] for m in GUARDED if m in BlockPool.__dict__}
    probe = Probe()
    installed: dict[str, Any] = {}
    try:
        for m, original in own.items():
            setattr(BlockPool, m, probe.inner(original))
        kvqueue.vllm.install(twin, pool_guard=guard, wrap_foreign=True)  # type: ignore[arg-type]
        for m in own:
            installed[m] = BlockPool.__dict__[m]
            assert bool(getattr(installed[m], "__kvqueue_guard__", False)) is guard, m
            setattr(BlockPool, m, probe.outer(installed[m], GUARDED.index(m)))
        driver = sched_engine.Driver(factory, specs)
        driver.run_workload(w, probe.clear)
    finally:
        for m, was in installed.items():  # the guard back, so that uninstall() finds it
            setattr(BlockPool, m, was)
        kvqueue.vllm.uninstall()
        for m, original in own.items():
            setattr(BlockPool, m, original)
    probe.fingerprint = driver.fingerprint
    return probe


def measure(
    factory: Any, specs: list[Any], w: Any, twins: list[str], reps: int, rng: random.Random,
    fingerprint: int,
) -> dict[str, Any]:  # fmt: skip
    """Per twin: the guard's ns per timed step, its calls and blocks per step; and the null
    test. Fails if a probed run schedules otherwise than vLLM alone, or calls otherwise."""
    runs = [(t, g) for t in twins for g in (True, False)]
    gaps: dict[tuple[str, bool], list[array[int]]] = {r: [] for r in runs}
    calls: array[int] | None = None
    sizes: dict[str, array[int]] = {}
    for _ in range(reps):
        rng.shuffle(runs)
        for twin, guard in runs:
            probe = probed_run(factory, specs, w, twin, guard)
            if probe.fingerprint != fingerprint:
                raise SystemExit(f"{twin} probed: the schedule differs from vLLM's alone")
            if calls is None:
                calls = probe.method
            elif probe.method != calls:
                raise SystemExit(f"{twin} probed: the guarded calls differ between runs")
            gaps[twin, guard].append(probe.gap)
            if guard:
                sizes[twin] = probe.size
    assert calls is not None
    steps = w.steps - w.warmup_steps

    def ns_per_step(run: tuple[str, bool]) -> float:
        return sum(map(median, zip(*gaps[run], strict=True))) / steps

    out: dict[str, Any] = {"twins": {}}
    for twin in twins:
        on, off = ns_per_step((twin, True)), ns_per_step((twin, False))
        per_method = dict.fromkeys(GUARDED, 0)
        blocks = dict.fromkeys(GUARDED, 0)
        for i, n in zip(calls, sizes[twin], strict=True):
            per_method[GUARDED[i]] += 1
            blocks[GUARDED[i]] += n
        out["twins"][twin] = {
            "guard_ns_per_step": on - off,
            "shim_ns_per_call": off * steps / max(len(calls), 1),
            "calls_per_step": {m: k / steps for m, k in per_method.items() if k},
            "blocks_per_step": {m: k / steps for m, k in blocks.items() if per_method[m]},
        }
    if len(twins) == 2:
        a, b = twins
        out["null_ns_per_step"] = ns_per_step((b, False)) - ns_per_step((a, False))
    return out
