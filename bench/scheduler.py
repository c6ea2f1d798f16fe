"""Engine-level benchmark on vLLM's real scheduler: vLLM's own queue, kvqueue's twins, the guard.

Usage and method: bench/README.md; runs in the venv of vllm_tests/venv.sh. vLLM's ``Scheduler``
(sched_engine.py) serves each workload per contender: ``vllm`` (vLLM alone), ``cython`` and
``python`` (``kvqueue.vllm.install(twin)``, the pool guard off), ``cython+guard`` and
``python+guard`` (on). Every run must schedule what vLLM alone did and leave the same pool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import random
import sys
import time
from array import array
from collections import Counter
from importlib import metadata
from statistics import median
from typing import Any, cast
from unittest.mock import patch

import launch
import sched_engine
from launch import bootstrap_median, interval
from sched_engine import WORKLOADS

from kvqueue.vllm import _pool_guard, _registry

GUARDED = tuple(_registry.GUARDED)

CONTENDERS = ("vllm", "cython", "cython+guard", "python", "python+guard")
REFERENCE = "vllm"
TWINS = ("cython", "python")
COST_REPS = 3  # probed runs per twin, guard on and off: odd, for a median per call


def use(name: str) -> type:
    """Bind vLLM's pool to contender ``name``'s queue; return the class its pools will hold."""
    from vllm.v1.core import block_pool

    import kvqueue.vllm

    kvqueue.vllm.uninstall()
    if name == REFERENCE:
        return cast(type, block_pool.FreeKVCacheBlockQueue)
    twin, _, guard = name.partition("+")
    queue_class = kvqueue.vllm.install(twin, pool_guard=bool(guard))  # type: ignore[arg-type]
    assert kvqueue.vllm.status()["pool_guard"] is bool(guard), name
    return queue_class


class _CountingQueue:
    """A queue that counts its calls by name (``popleft_n`` also its blocks) into ``calls``."""

    def __init__(self, queue_class: type, calls: Counter[str], blocks: list[Any]) -> None:
        self._q = queue_class(blocks)
        self._calls = calls

    @property
    def num_free_blocks(self) -> int:
        self._calls["num_free_blocks"] += 1
        return int(self._q.num_free_blocks)

    def popleft_n(self, n: int) -> Any:
        self._calls.update({"popleft_n": 1, "popleft_n>1": n > 1, "blocks_allocated": n})
        return self._q.popleft_n(n)

    def __getattr__(self, op: str) -> Any:
        method = getattr(self._q, op)

        def counted(*args: Any) -> Any:
            self._calls[op] += 1
            return method(*args)

        return counted


def pool_state(driver: sched_engine.Driver) -> tuple[Any, ...]:
    """The free list in order, and every block's id, reference count and hash."""
    free = [b.block_id for b in driver.pool.free_block_queue.get_all_free_blocks()]
    return free, [(b.block_id, b.ref_cnt, b.block_hash) for b in driver.pool.blocks]


def record_queue_calls(w: sched_engine.Workload) -> dict[str, Any]:
    """The workload ``w`` and one run of it on vLLM's queue, its calls after the warm-up counted
    and the prefix cache's evictions: what every other run must schedule and leave."""
    from vllm.v1.core import block_pool

    setup = sched_engine.Setup(w)
    original = use(REFERENCE)
    calls: Counter[str] = Counter()
    evict = block_pool.BlockPool._maybe_evict_cached_block

    def counting_evict(pool: Any, block: Any) -> bool:
        hit: bool = evict(pool, block)
        calls["evicted_blocks"] += hit
        return hit

    counting = functools.partial(_CountingQueue, original, calls)
    with (
        patch.object(block_pool, "FreeKVCacheBlockQueue", counting),
        patch.object(block_pool.BlockPool, "_maybe_evict_cached_block", counting_evict),
    ):
        driver = sched_engine.Driver(setup)
        driver.run(calls.clear)
    counters = {**driver.counters, "evicted_blocks": calls.pop("evicted_blocks", 0)}
    return {"setup": setup, "queue_calls": calls, "counters": counters,
            "fingerprint": driver.fingerprint, "pool": pool_state(driver)}  # fmt: skip


def run_contender(name: str, recorded: dict[str, Any]) -> float:
    """One timed run on contender ``name``; it must schedule what vLLM alone did and leave the
    same pool (``recorded``: record_queue_calls()'s), or the process fails."""
    queue_class = use(name)
    driver = sched_engine.Driver(recorded["setup"])
    assert type(driver.pool.free_block_queue) is queue_class, name
    elapsed = driver.run()
    where = f"{recorded['setup'].workload.name}, {name}"
    if driver.fingerprint != recorded["fingerprint"]:
        raise SystemExit(f"{where}: the schedule differs from vLLM's alone")
    if pool_state(driver) != recorded["pool"]:
        raise SystemExit(f"{where}: the pool after the run differs from vLLM's alone")
    return elapsed


# -- the pool guard's own time per step, probed call by call (a step-time difference is too
# noisy to show it). Each guarded ``BlockPool`` method gets an *inner* ``perf_counter_ns`` shim
# around vLLM's own method, which the guard wraps, and an *outer* one around what the pool's
# callers reach. Per call, gap = outer - inner: the guard's own work plus the shims' cost, which
# the same twin with the guard off gives alone, call for call (the schedule is deterministic,
# and checked). guard ns/step = (sum of median gaps, guard on - the same, guard off) / steps.
# calls ns/step: the same of outer alone. The guard reads the blocks before vLLM's method does,
# so the gap holds cache misses that the inner time, guard off, held: this one nets them out.
# The null test, python's guard-off gaps less cython's, should be 0: the queue runs outside.
# The manager's ``new_step_starts`` is probed likewise: the step guard's gap is the holder
# audit's time, its wrapper's included.


class Probe:
    """The two shims per guarded method, and what one run's calls recorded."""

    def __init__(self) -> None:
        self.method = array("b")  # index into GUARDED
        self.gap = array("q")  # outer - inner, ns
        self.whole = array("q")  # outer: the call as the pool's caller sees it, ns
        self.size = array("q")  # blocks screened; -1: not a list (guard off)
        self.step_gap = array("q")  # the same gap, of the manager's new_step_starts
        self._stack: list[list[int]] = []

    def clear(self) -> None:
        del self.method[:], self.gap[:], self.whole[:], self.size[:], self.step_gap[:]

    def inner(self, original: Any) -> Any:
        clock, stack = time.perf_counter_ns, self._stack

        def timed(owner: Any, *args: Any, **kwargs: Any) -> Any:
            start = clock()
            result = original(owner, *args, **kwargs)
            end = clock()
            slot = stack[-1]
            slot[0] = end - start
            arg = args[0] if args else None
            slot[1] = arg if type(arg) is int else len(arg) if type(arg) is list else -1
            return result

        # vLLM's names (the guard reads the method's name for its messages).
        return functools.update_wrapper(timed, original)

    def outer(self, target: Any, index: int) -> Any:
        clock, stack = time.perf_counter_ns, self._stack
        method, gap, whole, size = self.method, self.gap, self.whole, self.size

        def timed(owner: Any, *args: Any, **kwargs: Any) -> Any:
            slot = [0, -1]
            stack.append(slot)
            start = clock()
            result = target(owner, *args, **kwargs)
            end = clock()
            stack.pop()
            if index < 0:  # the step guard: the holder audit and its wrapper
                self.step_gap.append(end - start - slot[0])
                return result
            method.append(index)
            gap.append(end - start - slot[0])
            whole.append(end - start)
            size.append(slot[1])
            return result

        return timed


def probed_run(setup: sched_engine.Setup, twin: str, guard: bool) -> tuple[Probe, int]:
    """One run of ``setup`` on ``twin``, the guard on or off, every guarded call probed; the
    probe and the run's fingerprint."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    import kvqueue.vllm

    kvqueue.vllm.uninstall()
    hook = _registry.AUDIT_HOOK
    probe = Probe()
    # Undone in reverse: the outer shims (the guard back, so that uninstall() finds it), the
    # guard, the inner shims.
    with contextlib.ExitStack() as undo:
        own = [m for m in GUARDED if m in BlockPool.__dict__]
        for m in own:
            undo.enter_context(patch.object(BlockPool, m, probe.inner(BlockPool.__dict__[m])))
        step = KVCacheManager.__dict__[hook]
        undo.enter_context(patch.object(KVCacheManager, hook, probe.inner(step)))
        undo.callback(kvqueue.vllm.uninstall)
        kvqueue.vllm.install(twin, pool_guard=guard, wrap_foreign=True)  # type: ignore[arg-type]
        # Built under kvqueue's guard alone: a pool finds its guard when its holder index is
        # made, and gives its queue the free list's entry check only then. Built under the
        # outer shims, which hide the guard, it would run the path of a pool without one.
        driver = sched_engine.Driver(setup)
        queue = driver.scheduler.kv_cache_manager.block_pool.free_block_queue
        door = _pool_guard.is_door(getattr(queue, "gate", None))
        assert door is guard, "the probed pool runs the path of a pool without its guard"
        for m in own:
            installed = BlockPool.__dict__[m]
            assert (_pool_guard._ours(installed) is not None) is guard, m
            undo.enter_context(patch.object(BlockPool, m, probe.outer(installed, GUARDED.index(m))))
        step = KVCacheManager.__dict__[hook]
        assert (_pool_guard._ours(step) is not None) is guard, hook
        undo.enter_context(patch.object(KVCacheManager, hook, probe.outer(step, -1)))
        driver.run(probe.clear)
    return probe, driver.fingerprint


def probe_guard(recorded: dict[str, Any], reps: int, rng: random.Random) -> dict[str, Any]:
    """Per twin: the guard's ns per timed step, its calls and blocks per step; and the null
    test. Fails if a probed run schedules otherwise than vLLM alone, or calls otherwise."""
    setup = recorded["setup"]
    runs = [(t, g) for t in TWINS for g in (True, False)]
    gaps: dict[tuple[str, bool], list[array[int]]] = {r: [] for r in runs}
    wholes: dict[tuple[str, bool], list[array[int]]] = {r: [] for r in runs}
    step_gaps: dict[tuple[str, bool], list[array[int]]] = {r: [] for r in runs}
    sizes: dict[str, array[int]] = {}
    calls: array[int] | None = None
    for _ in range(reps):
        rng.shuffle(runs)
        for twin, guard in runs:
            probe, probed_fingerprint = probed_run(setup, twin, guard)
            where = f"{setup.workload.name}, {twin} probed"
            if probed_fingerprint != recorded["fingerprint"]:
                raise SystemExit(f"{where}: the schedule differs from vLLM's alone")
            if calls is None:
                calls = probe.method
            elif probe.method != calls:
                raise SystemExit(f"{where}: the guarded calls differ between runs")
            gaps[twin, guard].append(probe.gap)
            wholes[twin, guard].append(probe.whole)
            step_gaps[twin, guard].append(probe.step_gap)
            if guard:
                sizes[twin] = probe.size
    assert calls is not None
    steps = setup.workload.steps - setup.workload.warmup_steps

    def per_call(run: tuple[str, bool], probed: dict[Any, list[array[int]]] = gaps) -> list[float]:
        return list(map(median, zip(*probed[run], strict=True)))

    def ns_per_step(run: tuple[str, bool], probed: dict[Any, list[array[int]]] = gaps) -> float:
        return float(sum(per_call(run, probed)) / steps)

    out: dict[str, Any] = {"twins": {}}
    for twin in TWINS:
        gap_on, gap_off = per_call((twin, True)), per_call((twin, False))
        on, off = sum(gap_on) / steps, sum(gap_off) / steps
        per_method, blocks = dict.fromkeys(GUARDED, 0), dict.fromkeys(GUARDED, 0)
        own: dict[str, float] = dict.fromkeys(GUARDED, 0.0)
        for i, n, g_on, g_off in zip(calls, sizes[twin], gap_on, gap_off, strict=True):
            per_method[GUARDED[i]] += 1
            blocks[GUARDED[i]] += n
            own[GUARDED[i]] += g_on - g_off
        out["twins"][twin] = {
            "guard_ns_per_step": on - off,
            "calls_ns_per_step": ns_per_step((twin, True), wholes)
            - ns_per_step((twin, False), wholes),
            "audit_ns_per_step": ns_per_step((twin, True), step_gaps)
            - ns_per_step((twin, False), step_gaps),
            "shim_ns_per_call": off * steps / max(len(calls), 1),
            "calls_per_step": {m: k / steps for m, k in per_method.items() if k},
            # The guard's own time by method, a call: where a change to it would show.
            "guard_ns_per_call": {m: own[m] / k for m, k in per_method.items() if k},
            "blocks_per_step": {m: k / steps for m, k in blocks.items() if per_method[m]},
        }
    out["null_ns_per_step"] = ns_per_step(("python", False)) - ns_per_step(("cython", False))
    return out


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """One fresh process: per workload, one untimed run per contender (every contender's code
    and data warm), then ``reps`` timed runs each in a new random order, then the probes."""
    cpu = launch.pin()
    rng = random.Random(job["seed"])
    result: dict[str, Any] = {"cpu": cpu, "pid": os.getpid(), "workloads": {}}
    contenders = list(CONTENDERS)
    for w in rng.sample(list(WORKLOADS.values()), len(WORKLOADS)):
        if job["quick"]:
            w = dataclasses.replace(w, steps=w.steps // 2, warmup_steps=w.warmup_steps // 2)
        recorded = record_queue_calls(w)
        for name in contenders:
            run_contender(name, recorded)
        steps: dict[str, list[float]] = {n: [] for n in contenders}
        for _ in range(job["reps"]):
            rng.shuffle(contenders)
            for name in contenders:
                steps[name].append(run_contender(name, recorded))
        result["workloads"][w.name] = {
            "params": dataclasses.asdict(w), "timed_steps": w.steps - w.warmup_steps,
            "requests": len(recorded["setup"].specs), "counters": recorded["counters"],
            "queue_calls": recorded["queue_calls"], "step_s": steps,
            "guard_cost": probe_guard(recorded, COST_REPS, rng),
        }  # fmt: skip
    return result


def check() -> None:
    """CI: each contender once on short workloads over a small pool, the guard's probes once;
    the first difference stops it."""
    for wname, w in WORKLOADS.items():
        # A quarter of the steps, no warm-up, an eighth of the pool: it fills, and evicts.
        w = dataclasses.replace(w, steps=w.steps // 4, warmup_steps=0, num_blocks=w.num_blocks // 8)
        recorded = record_queue_calls(w)
        calls, counters = recorded["queue_calls"], recorded["counters"]
        reached = ", ".join(f"{k} {v}" for k, v in sorted({**calls, **counters}.items()))
        print(f"scheduler --check: {wname}, {w.steps} steps: {reached}", flush=True)
        needed = ["popleft_n", "popleft_n>1", "append_n", "prepend_n", "num_free_blocks"]
        needed += ["remove"] if wname == "prefix-heavy" else []
        missing = [op for op in needed if not calls.get(op)]
        missing += [k for k in ("evicted_blocks", "finished") if not counters[k]]
        if missing:
            raise SystemExit(f"scheduler --check: {wname}: the workload never reaches {missing}")
        for name in CONTENDERS:
            run_contender(name, recorded)
            print(f"scheduler --check: {wname} {name}: same schedule, same pool", flush=True)
        # The guard's probes work, and change no schedule.
        cost = probe_guard(recorded, 1, random.Random(0))
        for twin, c in cost["twins"].items():
            per = ", ".join(f"{m} {k:.1f}" for m, k in c["calls_per_step"].items())
            print(f"scheduler --check: {wname} {twin}+guard probed: same schedule; "
                  f"guarded calls per step: {per}", flush=True)  # fmt: skip
    use(REFERENCE)


# _CountingQueue's own tallies, not queue calls.
_DERIVED = ("blocks_allocated", "popleft_n>1")


def tables(data: dict[str, Any]) -> str:
    """The Markdown summary of a results file: step times, the guard's cost, the workloads."""
    steps, guard, nulls, shims, workloads = [], [], [], [], []
    for wname in data["records"][0]["workloads"]:
        per = [r["workloads"][wname] for r in data["records"]]
        n = per[0]["timed_steps"]
        step = [{c: median(p["step_s"][c]) for c in CONTENDERS} for p in per]  # per process
        for name in CONTENDERS:
            us = median(m[name] for m in step) / n * 1e6
            ratio = bootstrap_median([m[name] / m[REFERENCE] for m in step])
            spread = max(m[name] for m in step) / min(m[name] for m in step)
            steps.append(f"| {wname} | {name} | {us:.0f} | {interval(ratio)} | {spread:.3f} |")
        costs = [p["guard_cost"] for p in per]
        for twin in TWINS:
            on, probed = f"{twin}+guard", [c["twins"][twin] for c in costs]
            ratio = bootstrap_median([m[on] / m[twin] for m in step])
            delta = bootstrap_median([(m[on] - m[twin]) / n * 1e6 for m in step])
            own = bootstrap_median([c["guard_ns_per_step"] / 1e3 for c in probed])
            whole = bootstrap_median([c["calls_ns_per_step"] / 1e3 for c in probed])
            audit = bootstrap_median([c["audit_ns_per_step"] / 1e3 for c in probed])
            share = bootstrap_median(
                [
                    c["audit_ns_per_step"] / 1e3 / (m[on] / n * 1e6) * 100
                    for c, m in zip(probed, step, strict=True)
                ]
            )
            both = bootstrap_median(
                [
                    (c["guard_ns_per_step"] + c["audit_ns_per_step"])
                    / 1e3
                    / (m[on] / n * 1e6)
                    * 100
                    for c, m in zip(probed, step, strict=True)
                ]
            )
            calls = ", ".join(f"{m} {k:.2f}" for m, k in probed[0]["calls_per_step"].items())
            each = ", ".join(
                f"{m} {median(c['guard_ns_per_call'][m] for c in probed):.0f}"
                for m in probed[0]["calls_per_step"]
            )
            screened = ", ".join(f"{m} {k:.1f}" for m, k in probed[0]["blocks_per_step"].items())
            guard.append(
                f"| {wname} | {twin} | {interval(ratio)} | {interval(delta, 1)} "
                f"| {interval(own, 2)} | {interval(whole, 2)} | {interval(audit, 2)} "
                f"| {interval(share, 2)} "
                f"| {interval(both, 2)} | {calls} | {each} | {screened} |"
            )
            shims.append(median(c["shim_ns_per_call"] for c in probed))
        null = bootstrap_median([c["null_ns_per_step"] / 1e3 for c in costs])
        nulls.append(f"{wname} {interval(null, 2)} µs/step")
        c, q = per[0]["counters"], per[0]["queue_calls"]
        calls = ", ".join(f"{op} {k / n:.1f}" for op, k in sorted(q.items()) if op not in _DERIVED)
        workloads.append(
            f"- {wname}: {per[0]['requests']} requests, {n} timed steps after "
            f"{per[0]['params']['warmup_steps']}; per step {c['scheduled_tokens'] / n:.0f} tokens "
            f"scheduled, {c['admitted'] / n:.2f} requests admitted, {c['finished'] / n:.2f} "
            f"finished, {c['preempted'] / n:.3f} preempted; "
            f"{q.get('blocks_allocated', 0) / n:.1f} blocks allocated "
            f"({c['evicted_blocks'] / n:.1f} evicted from the prefix cache); queue calls {calls}."
        )
    s = data["settings"]
    lines = [
        f"vLLM {data['vllm']}'s `Scheduler` on the CPU (fake model), per contender: median of "
        f"{s['processes']} fresh processes x {s['reps']} runs, [bootstrap 95% interval]. "
        "Step: thread CPU time of `schedule()` + `update_from_output()`.",
        "",
        "| workload | contender | µs/step | step vs vllm | spread over processes |",
        "|---|---|---:|---|---:|",
        *steps,
        "",
        "The pool guard: each twin with the guard on against the same twin with it off, "
        "in the same processes.",
        "",
        "*step Δ*: the step-time difference (the guard, the audit, the holder index's "
        "bookkeeping and the runs' noise); *guard µs/step*: the guard's own time, probed call "
        f"by call (bench/scheduler.py: median of {s['cost_reps']} probed runs per call, guard on "
        "less guard off, summed per step); *calls on less off*: the same for the whole guarded "
        "call, vLLM's method in it (which finds in the cache the blocks the guard read first).",
        "",
        "*audit µs/step*: the step guard's own time (the holder audit and its wrapper), probed "
        "as the guard's is, at the manager's `new_step_starts`, and its share of the step with "
        "the guard on; *guard + audit*: their sum's share of that step; *guard ns a call*: the "
        "guard's own time by method, a call (the median over processes).",
        "",
        "| workload | twin | step, guard on / off | step Δ µs | guard µs/step "
        "| calls on less off µs/step | audit µs/step | audit % of step | guard + audit % of step "
        "| guarded calls/step | guard ns a call | blocks screened/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *guard,
        "",
        "The probe's error: the null test (guard off, python's gaps less cython's, which should "
        f"be 0) gives {'; '.join(nulls)}. The shims' own cost subtracted: "
        f"{min(shims):.0f}-{max(shims):.0f} ns a call.",
        "",
        "Workloads (per timed step, from the recorded run on vLLM's queue):",
        *workloads,
        "",
        f"Machine: {launch.short(data['machine'])}; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in data['loadavg'])}.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = launch.parser(__doc__, "3 processes, half the steps")
    parser.add_argument("--check", action="store_true", help="equivalence only, no timing")
    parser.add_argument("--processes", type=int, help="fresh processes (7; quick 3)")
    parser.add_argument("--reps", type=int, help="runs per contender per process (5; quick 3)")
    args = parser.parse_args()
    if args.check:
        check()
        return
    defaults = (3, 3) if args.quick else (7, 5)
    processes, reps = args.processes or defaults[0], args.reps or defaults[1]
    rng = random.Random(0)
    jobs = [{"label": f"round {i + 1}", "seed": rng.randrange(2**32), "reps": reps,
             "quick": args.quick} for i in range(processes)]  # fmt: skip
    records = launch.run(worker, jobs)
    settings = {"processes": processes, "reps": reps, "quick": args.quick, "cost_reps": COST_REPS}
    data = {"machine": launch.describe(), "vllm": metadata.version("vllm"), "settings": settings,
            "loadavg": os.getloadavg(), "records": records}  # fmt: skip
    out = launch.save(data, args.out, "scheduler")
    print(tables(data))
    print(f"\n(raw results: {out})", file=sys.stderr)


if __name__ == "__main__":
    main()
