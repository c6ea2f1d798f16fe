"""Engine-level benchmark on vLLM's real scheduler: vLLM's own queue, kvqueue's twins, the guard.

    make bench-scheduler                        # the vLLM venv, full run (about 30 minutes)
    python bench/scheduler.py --quick           # 3 processes, half the steps
    python bench/scheduler.py --check           # no timing: every contender schedules alike
    python bench/scheduler.py --summarize bench/results/scheduler-....json

Runs in the venv of vllm_tests/venv.sh (vLLM as vllm_tests/vllm.env pins it, and kvqueue).
vLLM's own ``Scheduler`` (bench/sched_engine.py: its real KVCacheManager and BlockPool, on the
CPU, a fake model) serves the seeded workloads of bench/sched_workload.py. Contenders: ``vllm``
(vLLM alone), ``cython`` and ``python`` (``kvqueue.vllm.install(twin, pool_guard=False)``),
``cython+guard`` and ``python+guard`` (the pool guard on). A kvqueue whose ``install()`` has
no ``pool_guard`` parameter runs without the guard contenders, and says so.

Per fresh process (bench/launch.py) and per workload: one untimed run per contender, then
``--reps`` runs each, the contenders in a new random order every time, the collector off.
*Step time* is the thread CPU time inside ``schedule()`` + ``update_from_output()`` over the
steps after the warm-up. Every run must schedule exactly what vLLM alone did (a fingerprint of
every step's requests, tokens and block ids) and leave the same pool (the free list in order,
every block's reference count and hash), or the process fails. Ratios are taken within a
process (against ``vllm``; the guard's against the same twin with the guard off), then the
median over processes with a bootstrap 95% interval (bench/stats.py). The queue's own time is
the microbenchmark's (bench/run.py); here one run on vLLM's queue counts its calls per step.
The guard's own µs per step, which the step-time difference is too noisy to show, is probed
call by call for each twin (bench/sched_cost.py: ``--cost-reps`` runs guard on and off).
Results: bench/results/scheduler-*.json and a Markdown table on stdout.

``--check`` (CI) runs each contender once on short workloads over a small pool (it fills and
evicts), and fails on any such difference, or when the workloads miss a queue call the pool
makes or the prefix cache's eviction; it also runs the guard's probes once per twin.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import os
import random
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CONTENDERS = ("vllm", "cython", "cython+guard", "python", "python+guard")
REFERENCE = "vllm"
CLOCK = time.thread_time


# -- the contenders ------------------------------------------------------------------------


def guard_missing() -> str | None:
    """Why the guard contenders cannot run here, or None."""
    import kvqueue.vllm

    if "pool_guard" in inspect.signature(kvqueue.vllm.install).parameters:
        return None
    return "kvqueue.vllm.install() has no pool_guard parameter: this kvqueue has no pool guard"


def use(name: str) -> type:
    """Bind vLLM's pool to contender ``name``'s queue; return the class its pools will hold."""
    from vllm.v1.core import block_pool

    import kvqueue.vllm

    kvqueue.vllm.uninstall()
    if name == REFERENCE:
        queue_class: type = block_pool.FreeKVCacheBlockQueue
        return queue_class
    twin, _, guard = name.partition("+")
    if guard_missing():
        return kvqueue.vllm.install(twin)  # type: ignore[arg-type]
    queue_class = kvqueue.vllm.install(twin, pool_guard=bool(guard))  # type: ignore[arg-type, call-arg]
    status = kvqueue.vllm.status()  # type: ignore[attr-defined]
    assert status["pool_guard"] is bool(guard), (name, status)
    return queue_class


# -- the queue calls of one run, counted ---------------------------------------------------


class QueueCounter:
    """Stands for a queue class: builds ``queue_class`` queues that count their calls."""

    def __init__(self, queue_class: type) -> None:
        self.queue_class = queue_class
        self.calls: dict[str, int] = {}

    def __call__(self, blocks: list[Any]) -> Any:
        return _CountingQueue(self.queue_class(blocks), self.calls)


class _CountingQueue:
    def __init__(self, queue: Any, calls: dict[str, int]) -> None:
        self._q = queue
        self._calls = calls

    def _count(self, op: str, n: int = 1) -> None:
        self._calls[op] = self._calls.get(op, 0) + n

    @property
    def num_free_blocks(self) -> int:
        self._count("num_free_blocks")
        return int(self._q.num_free_blocks)

    def popleft_n(self, n: int) -> Any:
        self._count("popleft_n")
        self._count("popleft_n>1", n > 1)
        self._count("blocks_allocated", n)
        return self._q.popleft_n(n)

    def __getattr__(self, op: str) -> Any:
        """Every other method, counted by name."""
        method = getattr(self._q, op)
        if not callable(method):
            return method

        def counted(*args: Any) -> Any:
            self._count(op)
            return method(*args)

        return counted


# -- one fresh process ---------------------------------------------------------------------


def shrink(w: Any, factor: int) -> Any:
    return dataclasses.replace(w, steps=w.steps // factor, warmup_steps=w.warmup_steps // factor)


def timed_run(driver: Any, w: Any) -> float:
    gc.collect()
    gc.disable()
    try:
        driver.run(w.warmup_steps, CLOCK)
        return float(driver.run(w.steps - w.warmup_steps, CLOCK))
    finally:
        gc.enable()


def run_contender(name: str, factory: Any, specs: list[Any], w: Any, reference: Any) -> float:
    """One timed run on contender ``name``; it must schedule what vLLM alone did and leave the
    same pool (``reference``: ``record_queue_calls()``'s), or the process fails."""
    import sched_engine

    queue_class = use(name)
    driver = sched_engine.Driver(factory, specs)
    assert type(sched_engine.block_pool(driver.scheduler).free_block_queue) is queue_class, name
    elapsed = timed_run(driver, w)
    if driver.fingerprint != reference["fingerprint"]:
        raise SystemExit(f"{name}: the schedule differs from vLLM's alone")
    if pool_state(driver) != reference["pool"]:
        raise SystemExit(f"{name}: the pool after the run differs from vLLM's alone")
    return elapsed


def pool_state(driver: Any) -> tuple[Any, ...]:
    """The free list in order, and every block's id, reference count and hash."""
    import sched_engine

    pool = sched_engine.block_pool(driver.scheduler)
    free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    return free, [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks]


def record_queue_calls(factory: Any, specs: list[Any], w: Any) -> dict[str, Any]:
    """One run on vLLM's queue with its calls counted (after the warm-up), and evictions."""
    import sched_engine
    from vllm.v1.core import block_pool

    original = use(REFERENCE)
    log = QueueCounter(original)
    evict = block_pool.BlockPool._maybe_evict_cached_block
    evicted = [0]

    def counting_evict(pool: Any, block: Any) -> bool:
        hit: bool = evict(pool, block)
        evicted[0] += hit
        return hit

    block_pool.FreeKVCacheBlockQueue = log  # type: ignore[attr-defined]
    block_pool.BlockPool._maybe_evict_cached_block = counting_evict  # type: ignore[method-assign]
    try:
        driver = sched_engine.Driver(factory, specs)
        driver.run(w.warmup_steps, CLOCK)
        evicted_warmup, before = evicted[0], dict(driver.counters)
        log.calls.clear()
        driver.run(w.steps - w.warmup_steps, CLOCK)
    finally:
        block_pool.FreeKVCacheBlockQueue = original  # type: ignore[attr-defined]
        block_pool.BlockPool._maybe_evict_cached_block = evict  # type: ignore[method-assign]
    counters = {k: v - before[k] for k, v in driver.counters.items()}
    counters["evicted_blocks"] = evicted[0] - evicted_warmup
    return {"counters": counters, "queue_calls": log.calls, "fingerprint": driver.fingerprint,
            "pool": pool_state(driver)}  # fmt: skip


def worker(job: dict[str, Any]) -> dict[str, Any]:
    from launch import pin

    cpu = pin(job.get("cpu"))
    import sched_cost
    import sched_engine
    import sched_workload

    rng = random.Random(job["seed"])
    model = sched_engine.model_dir()
    result: dict[str, Any] = {"cpu": cpu, "pid": os.getpid(), "workloads": {}}
    names = list(job["workloads"])
    rng.shuffle(names)
    contenders = list(job["contenders"])
    for wname in names:
        w = shrink(sched_workload.WORKLOADS[wname], 2 if job["quick"] else 1)
        specs = sched_workload.make_workload(w)
        factory = sched_engine.SchedulerFactory(w, model)
        recorded = record_queue_calls(factory, specs, w)
        for name in contenders:  # untimed: every contender's code and data warm
            run_contender(name, factory, specs, w, recorded)
        steps: dict[str, list[float]] = {n: [] for n in contenders}
        for _ in range(job["reps"]):
            rng.shuffle(contenders)
            for name in contenders:
                steps[name].append(run_contender(name, factory, specs, w, recorded))
        use(REFERENCE)
        twins = [n for n in job["contenders"] if "+" not in n and f"{n}+guard" in contenders]
        cost = None
        if twins and job["cost_reps"]:
            cost = sched_cost.measure(
                factory, specs, w, twins, job["cost_reps"], rng, recorded["fingerprint"]
            )
        result["workloads"][wname] = {
            "params": dataclasses.asdict(w),
            "timed_steps": w.steps - w.warmup_steps,
            "requests": len(specs),
            "counters": recorded["counters"],
            "queue_calls": recorded["queue_calls"],
            "step_s": steps,
            "guard_cost": cost,
        }
    return result


# -- the equivalence check (CI) ------------------------------------------------------------


def check(workloads: list[str], contenders: list[str]) -> int:
    import sched_cost
    import sched_engine
    import sched_workload

    model = sched_engine.model_dir()
    failures = []
    for wname in workloads:
        # A quarter of the steps, no warm-up, an eighth of the pool: it fills, and evicts.
        w = sched_workload.WORKLOADS[wname]
        w = dataclasses.replace(w, steps=w.steps // 4, warmup_steps=0, num_blocks=w.num_blocks // 8)
        specs = sched_workload.make_workload(w)
        factory = sched_engine.SchedulerFactory(w, model)
        recorded = record_queue_calls(factory, specs, w)
        calls, counters = recorded["queue_calls"], recorded["counters"]
        needed = ["popleft_n", "popleft_n>1", "append_n", "prepend_n", "num_free_blocks"]
        needed += ["remove"] if wname == "prefix-heavy" else []
        missing = [op for op in needed if not calls.get(op)]
        missing += [k for k in ("evicted_blocks", "finished") if not counters[k]]
        if missing:
            failures.append(f"{wname}: the workload never reaches {missing}")
        reached = ", ".join(f"{k} {v}" for k, v in sorted({**calls, **counters}.items()))
        print(f"scheduler --check: {wname}, {w.steps} steps: {reached}", flush=True)
        for name in contenders:
            try:
                run_contender(name, factory, specs, w, recorded)
            except SystemExit as exc:
                failures.append(f"{wname}: {exc}")
                continue
            print(f"scheduler --check: {wname} {name}: same schedule, same pool", flush=True)
        twins = [n for n in contenders if "+" not in n and f"{n}+guard" in contenders]
        if twins:  # the guard's probes (sched_cost.py) work, and change no schedule
            try:
                cost = sched_cost.measure(
                    factory, specs, w, twins, 1, random.Random(0), recorded["fingerprint"]
                )
            except SystemExit as exc:
                failures.append(f"{wname}: {exc}")
                continue
            for twin, c in cost["twins"].items():
                per = ", ".join(f"{m} {k:.1f}" for m, k in c["calls_per_step"].items())
                print(f"scheduler --check: {wname} {twin}+guard probed: same schedule; "
                      f"guarded calls per step: {per}", flush=True)  # fmt: skip
    use(REFERENCE)
    for failure in failures:
        print(f"scheduler --check: FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


# -- the parent: processes, summary --------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    import launch
    import machine

    rng = random.Random(args.seed)
    jobs = [
        {"round": round_, "workloads": args.workloads, "contenders": args.contenders,
         "seed": rng.randrange(2**32), "reps": args.reps, "quick": args.quick, "cpu": args.cpu,
         "cost_reps": args.cost_reps}
        for round_ in range(args.processes)
    ]  # fmt: skip
    command = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    records = launch.run(command, jobs, lambda job: f"round {job['round'] + 1}")
    return {
        "machine": machine.describe(),
        "vllm": _vllm_version(),
        "settings": {
            "processes": args.processes,
            "reps": args.reps,
            "cost_reps": args.cost_reps,
            "quick": args.quick,
            "seed": args.seed,
            "contenders": args.contenders,
            "skipped": args.skipped,
        },
        "loadavg": os.getloadavg(),
        "kvqueue_sources": _kvqueue_stamp(),
        "records": records,
    }


def _kvqueue_stamp() -> str:
    """A hash of the kvqueue package the workers import (its files, .so included)."""
    import hashlib

    import kvqueue

    digest = hashlib.sha256()
    for path in sorted(Path(kvqueue.__file__).parent.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _vllm_version() -> str:
    from importlib import metadata

    return metadata.version("vllm")


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    from stats import bootstrap_median

    records = data["records"]
    names = data["settings"]["contenders"]
    summary: dict[str, Any] = {}
    for wname in records[0]["workloads"]:
        per = [r["workloads"][wname] for r in records]
        steps = per[0]["timed_steps"]
        step = [{n: median(p["step_s"][n]) for n in names} for p in per]  # per process
        rows: dict[str, Any] = {}
        for name in names:
            rows[name] = {
                "us_per_step": median(m[name] for m in step) / steps * 1e6,
                "step_ratio": bootstrap_median([m[name] / m[REFERENCE] for m in step]),
                "process_spread": max(m[name] for m in step) / min(m[name] for m in step),
            }
        guard = {}
        costs = [p.get("guard_cost") for p in per]
        for name in names:
            twin, _, on = name.partition("+")
            if on and twin in names:
                guard[twin] = {
                    "ratio": bootstrap_median([m[name] / m[twin] for m in step]),
                    "us_per_step": bootstrap_median(
                        [(m[name] - m[twin]) / steps * 1e6 for m in step]
                    ),
                }
                if all(c and twin in c["twins"] for c in costs):
                    probed = [c["twins"][twin] for c in costs]  # type: ignore[index]
                    guard[twin]["probed_us_per_step"] = bootstrap_median(
                        [c["guard_ns_per_step"] / 1e3 for c in probed]
                    )
                    guard[twin]["shim_ns_per_call"] = median(c["shim_ns_per_call"] for c in probed)
                    guard[twin]["calls_per_step"] = probed[0]["calls_per_step"]
                    guard[twin]["blocks_per_step"] = probed[0]["blocks_per_step"]
        nulls = [c.get("null_ns_per_step") for c in costs if c]
        null = bootstrap_median([x / 1e3 for x in nulls]) if nulls and None not in nulls else None
        summary[wname] = {
            "params": per[0]["params"],
            "timed_steps": steps,
            "requests": per[0]["requests"],
            "counters": per[0]["counters"],
            "queue_calls": per[0]["queue_calls"],
            "rows": rows,
            "guard": guard,
            "probe_null_us_per_step": null,
        }
    return summary


_DERIVED = ("blocks_allocated", "popleft_n>1")


def _fmt(est: list[float] | tuple[float, float, float], digits: int = 3) -> str:
    return f"{est[0]:.{digits}f} [{est[1]:.{digits}f}, {est[2]:.{digits}f}]"


def markdown(data: dict[str, Any], summary: dict[str, Any]) -> str:
    import machine

    s = data["settings"]
    lines = [
        f"vLLM {data['vllm']}'s `Scheduler` on the CPU (fake model), per contender: median of "
        f"{s['processes']} fresh processes x {s['reps']} runs, [bootstrap 95% interval]. "
        "Step: thread CPU time of `schedule()` + `update_from_output()`.",
        "",
        "| workload | contender | µs/step | step vs vllm | spread over processes |",
        "|---|---|---:|---|---:|",
    ]
    for wname, t in summary.items():
        for name, row in t["rows"].items():
            lines.append(
                f"| {wname} | {name} | {row['us_per_step']:.0f} | {_fmt(row['step_ratio'])} | "
                f"{row['process_spread']:.3f} |"
            )
    if any(t["guard"] for t in summary.values()):
        lines += [
            "",
            "The pool guard: each twin with the guard on against the same twin with it off, "
            "in the same processes.",
            "",
            "*step Δ*: the step-time difference (noise, not the guard's cost); *guard µs/step*: "
            "the guard's own time, probed call by call (bench/sched_cost.py: median of "
            f"{s.get('cost_reps', '?')} probed runs per call, guard on less guard off, "
            "summed per step).",
            "",
            "| workload | twin | step, guard on / off | step Δ µs | guard µs/step | "
            "guarded calls/step | blocks screened/step |",
            "|---|---|---|---|---|---|---|",
        ]
        for wname, t in summary.items():
            for twin, g in t["guard"].items():
                probed, calls, screened = "n/a", "", ""
                if "probed_us_per_step" in g:
                    probed = _fmt(g["probed_us_per_step"], 2)
                    calls = ", ".join(f"{m} {k:.2f}" for m, k in g["calls_per_step"].items())
                    screened = ", ".join(f"{m} {k:.1f}" for m, k in g["blocks_per_step"].items())
                lines.append(
                    f"| {wname} | {twin} | {_fmt(g['ratio'])} | {_fmt(g['us_per_step'], 1)} | "
                    f"{probed} | {calls} | {screened} |"
                )
        nulls = [(w, t["probe_null_us_per_step"]) for w, t in summary.items()]
        shims = [
            g["shim_ns_per_call"]
            for t in summary.values()
            for g in t["guard"].values()
            if "shim_ns_per_call" in g
        ]
        if shims and all(n for _, n in nulls):
            lines += [
                "",
                "The probe's error: the null test (guard off, python's gaps less cython's, "
                "which should be 0) gives "
                + "; ".join(f"{w} {_fmt(n, 2)} µs/step" for w, n in nulls)
                + f". The shims' own cost subtracted: {min(shims):.0f}-{max(shims):.0f} ns a call.",
            ]
    if s["skipped"]:
        lines += ["", f"Not run: {s['skipped']}."]
    lines += ["", "Workloads (per timed step, from the recorded run on vLLM's queue):"]
    for wname, t in summary.items():
        n, c, q = t["timed_steps"], t["counters"], t["queue_calls"]
        calls = [f"{op} {k / n:.1f}" for op, k in sorted(q.items()) if op not in _DERIVED]
        lines.append(
            f"- {wname}: {t['requests']} requests, {n} timed steps after "
            f"{t['params']['warmup_steps']}; per step {c['scheduled_tokens'] / n:.0f} tokens "
            f"scheduled, {c['admitted'] / n:.2f} requests admitted, {c['finished'] / n:.2f} "
            f"finished, {c['preempted'] / n:.3f} preempted; "
            f"{q.get('blocks_allocated', 0) / n:.1f} blocks allocated "
            f"({c['evicted_blocks'] / n:.1f} evicted from the prefix cache); queue calls "
            + ", ".join(calls)
            + "."
        )
    lines += [
        "",
        f"Machine: {machine.short(data['machine'])}; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in data['loadavg'])}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import sched_workload

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="3 processes, half the steps")
    parser.add_argument("--check", action="store_true", help="equivalence only, no timing")
    parser.add_argument("--processes", type=int, help="fresh processes (7; quick 3)")
    parser.add_argument("--reps", type=int, help="runs per contender per process (5; quick 3)")
    parser.add_argument(
        "--cost-reps",
        type=int,
        help="probed runs per twin, guard on and off (3, odd: a median per call; 0: none)",
    )
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated")
    parser.add_argument(
        "--workloads", default=",".join(sched_workload.WORKLOADS), help="comma-separated"
    )
    parser.add_argument("--cpu", type=int, help="pin to this CPU (default: the last allowed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/...)")
    parser.add_argument("--summarize", type=Path, help="re-tabulate a results JSON")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.summarize:
        data = json.loads(args.summarize.read_text())
        print(markdown(data, summarize(data)))
        return 0
    args.workloads = args.workloads.split(",")
    args.contenders = [REFERENCE] + [c for c in args.contenders.split(",") if c != REFERENCE]
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)} (known: {', '.join(CONTENDERS)})")
    args.skipped = ""
    why = guard_missing()
    if why and any("+" in c for c in args.contenders):
        args.skipped = ", ".join(c for c in args.contenders if "+" in c) + f" ({why})"
        args.contenders = [c for c in args.contenders if "+" not in c]
        print(f"scheduler: skipping {args.skipped}", file=sys.stderr)
    if args.check:
        return check(args.workloads, args.contenders)
    args.processes = args.processes or (3 if args.quick else 7)
    args.reps = args.reps or (3 if args.quick else 5)
    if args.cost_reps is None:
        args.cost_reps = 3
    data = run(args)
    out = args.out or RESULTS / f"scheduler-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    data["summary"] = summarize(data)
    out.write_text(json.dumps(data, indent=1))
    print(markdown(data, data["summary"]))
    print(f"\n(raw results: {out})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
