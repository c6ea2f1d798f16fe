"""Engine-level benchmark on vLLM's real scheduler: vLLM's own queue, kvqueue's twins, the guard.

Usage and method: bench/README.md; runs in the venv of vllm_tests/venv.sh. vLLM's own
``Scheduler`` (sched_engine.py) serves the workloads of sched_workload.py per contender:
``vllm`` (vLLM alone), ``cython`` and ``python`` (``kvqueue.vllm.install(twin)``, the pool
guard off), ``cython+guard`` and ``python+guard`` (on; left out, and said so, where this
kvqueue's ``install()`` has no ``pool_guard``). Every run must schedule what vLLM alone did
and leave the same pool. The guard's own time is probed call by call (sched_cost.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
import random
import sys
from importlib import metadata
from statistics import median
from typing import Any

import launch
import sched_cost
import sched_engine
import sched_workload
from launch import bootstrap_median, interval

CONTENDERS = ("vllm", "cython", "cython+guard", "python", "python+guard")
REFERENCE = "vllm"


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


def guarded_twins(contenders: list[str]) -> list[str]:
    return [n for n in contenders if "+" not in n and f"{n}+guard" in contenders]


class _CountingQueue:
    """A queue that counts its calls by name (``popleft_n`` also its blocks) into ``calls``."""

    def __init__(self, queue_class: type, calls: dict[str, int], blocks: list[Any]) -> None:
        self._q = queue_class(blocks)
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
        method = getattr(self._q, op)
        if not callable(method):
            return method

        def counted(*args: Any) -> Any:
            self._count(op)
            return method(*args)

        return counted


def pool_state(driver: Any) -> tuple[Any, ...]:
    """The free list in order, and every block's id, reference count and hash."""
    pool = sched_engine.block_pool(driver.scheduler)
    free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    return free, [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks]


def record_queue_calls(w: Any, model: str) -> dict[str, Any]:
    """The workload ``w`` and one run of it on vLLM's queue, its calls after the warm-up counted
    and the prefix cache's evictions: what every other run must schedule and leave."""
    from vllm.v1.core import block_pool

    specs = sched_workload.make_workload(w)
    factory = sched_engine.SchedulerFactory(w, model)
    original = use(REFERENCE)
    calls: dict[str, int] = {}
    evict = block_pool.BlockPool._maybe_evict_cached_block
    evicted = [0]

    def counting_evict(pool: Any, block: Any) -> bool:
        hit: bool = evict(pool, block)
        evicted[0] += hit
        return hit

    block_pool.FreeKVCacheBlockQueue = functools.partial(_CountingQueue, original, calls)  # type: ignore[attr-defined]
    block_pool.BlockPool._maybe_evict_cached_block = counting_evict  # type: ignore[method-assign]
    try:
        driver = sched_engine.Driver(factory, specs)
        before: dict[str, int] = {}

        def after_warmup() -> None:
            before.update(driver.counters, evicted_blocks=evicted[0])
            calls.clear()

        driver.run_workload(w, after_warmup)
    finally:
        block_pool.FreeKVCacheBlockQueue = original  # type: ignore[attr-defined]
        block_pool.BlockPool._maybe_evict_cached_block = evict  # type: ignore[method-assign]
    counters = {**driver.counters, "evicted_blocks": evicted[0]}
    return {"specs": specs, "factory": factory, "w": w, "queue_calls": calls,
            "counters": {k: v - before[k] for k, v in counters.items()},
            "fingerprint": driver.fingerprint, "pool": pool_state(driver)}  # fmt: skip


def run_contender(name: str, recorded: dict[str, Any]) -> float:
    """One timed run on contender ``name``; it must schedule what vLLM alone did and leave the
    same pool (``recorded``: record_queue_calls()'s), or the process fails."""
    queue_class = use(name)
    driver = sched_engine.Driver(recorded["factory"], recorded["specs"])
    assert type(sched_engine.block_pool(driver.scheduler).free_block_queue) is queue_class, name
    elapsed = driver.run_workload(recorded["w"])
    if driver.fingerprint != recorded["fingerprint"]:
        raise SystemExit(f"{name}: the schedule differs from vLLM's alone")
    if pool_state(driver) != recorded["pool"]:
        raise SystemExit(f"{name}: the pool after the run differs from vLLM's alone")
    return elapsed


def probe_guard(recorded: dict[str, Any], twins: list[str], reps: int, rng: random.Random) -> Any:
    r = recorded
    return sched_cost.measure(r["factory"], r["specs"], r["w"], twins, reps, rng, r["fingerprint"])


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """One fresh process: per workload, one untimed run per contender (every contender's code
    and data warm), then ``reps`` timed runs each in a new random order, then the probes."""
    cpu = launch.pin()
    rng = random.Random(job["seed"])
    model = sched_engine.model_dir()
    result: dict[str, Any] = {"cpu": cpu, "pid": os.getpid(), "workloads": {}}
    names = list(job["workloads"])
    rng.shuffle(names)
    contenders = list(job["contenders"])
    for wname in names:
        w = sched_workload.WORKLOADS[wname]
        if job["quick"]:
            w = dataclasses.replace(w, steps=w.steps // 2, warmup_steps=w.warmup_steps // 2)
        recorded = record_queue_calls(w, model)
        for name in contenders:
            run_contender(name, recorded)
        steps: dict[str, list[float]] = {n: [] for n in contenders}
        for _ in range(job["reps"]):
            rng.shuffle(contenders)
            for name in contenders:
                steps[name].append(run_contender(name, recorded))
        use(REFERENCE)
        twins = guarded_twins(job["contenders"])
        cost = (
            probe_guard(recorded, twins, job["cost_reps"], rng)
            if twins and job["cost_reps"]
            else None
        )
        result["workloads"][wname] = {
            "params": dataclasses.asdict(w), "timed_steps": w.steps - w.warmup_steps,
            "requests": len(recorded["specs"]), "counters": recorded["counters"],
            "queue_calls": recorded["queue_calls"], "step_s": steps, "guard_cost": cost,
        }  # fmt: skip
    return result


def check(workloads: list[str], contenders: list[str]) -> int:
    """CI: each contender once on short workloads over a small pool; the guard's probes once."""
    model = sched_engine.model_dir()
    failures = []
    for wname in workloads:
        # A quarter of the steps, no warm-up, an eighth of the pool: it fills, and evicts.
        w = sched_workload.WORKLOADS[wname]
        w = dataclasses.replace(w, steps=w.steps // 4, warmup_steps=0, num_blocks=w.num_blocks // 8)
        recorded = record_queue_calls(w, model)
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
                run_contender(name, recorded)
            except SystemExit as exc:
                failures.append(f"{wname}: {exc}")
                continue
            print(f"scheduler --check: {wname} {name}: same schedule, same pool", flush=True)
        twins = guarded_twins(contenders)
        if twins:  # the guard's probes work, and change no schedule
            try:
                cost = probe_guard(recorded, twins, 1, random.Random(0))
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    jobs = [
        {"label": f"round {round_ + 1}", "workloads": args.workloads,
         "contenders": args.contenders, "seed": rng.randrange(2**32), "reps": args.reps,
         "quick": args.quick, "cost_reps": args.cost_reps}
        for round_ in range(args.processes)
    ]  # fmt: skip
    records = launch.run(worker, jobs)
    settings = ("processes", "reps", "cost_reps", "quick", "contenders", "skipped")
    return {
        "machine": launch.describe(),
        "vllm": metadata.version("vllm"),
        "settings": {k: getattr(args, k) for k in settings},
        "loadavg": os.getloadavg(),
        "records": records,
    }


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    records = data["records"]
    names = data["settings"]["contenders"]
    summary: dict[str, Any] = {}
    for wname in records[0]["workloads"]:
        per = [r["workloads"][wname] for r in records]
        steps = per[0]["timed_steps"]
        step = [{n: median(p["step_s"][n]) for n in names} for p in per]  # per process
        rows = {
            name: {
                "us_per_step": median(m[name] for m in step) / steps * 1e6,
                "step_ratio": bootstrap_median([m[name] / m[REFERENCE] for m in step]),
                "process_spread": max(m[name] for m in step) / min(m[name] for m in step),
            }
            for name in names
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
                    guard[twin].update(
                        probed_us_per_step=bootstrap_median(
                            [c["guard_ns_per_step"] / 1e3 for c in probed]
                        ),
                        shim_ns_per_call=median(c["shim_ns_per_call"] for c in probed),
                        calls_per_step=probed[0]["calls_per_step"],
                        blocks_per_step=probed[0]["blocks_per_step"],
                    )
        nulls = [c.get("null_ns_per_step") for c in costs if c]
        null = bootstrap_median([x / 1e3 for x in nulls]) if nulls and None not in nulls else None
        summary[wname] = {
            **{k: per[0][k] for k in ("params", "timed_steps", "requests", "counters")},
            "queue_calls": per[0]["queue_calls"], "rows": rows, "guard": guard,
            "probe_null_us_per_step": null,
        }  # fmt: skip
    return summary


_DERIVED = ("blocks_allocated", "popleft_n>1")


def markdown(data: dict[str, Any], summary: dict[str, Any]) -> str:
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
                f"| {wname} | {name} | {row['us_per_step']:.0f} | {interval(row['step_ratio'])} | "
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
                    probed = interval(g["probed_us_per_step"], 2)
                    calls = ", ".join(f"{m} {k:.2f}" for m, k in g["calls_per_step"].items())
                    screened = ", ".join(f"{m} {k:.1f}" for m, k in g["blocks_per_step"].items())
                lines.append(
                    f"| {wname} | {twin} | {interval(g['ratio'])} | "
                    f"{interval(g['us_per_step'], 1)} | {probed} | {calls} | {screened} |"
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
                + "; ".join(f"{w} {interval(n, 2)} µs/step" for w, n in nulls)
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
        f"Machine: {launch.short(data['machine'])}; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in data['loadavg'])}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = launch.parser(__doc__, "3 processes, half the steps")
    parser.add_argument("--check", action="store_true", help="equivalence only, no timing")
    parser.add_argument("--processes", type=int, help="fresh processes (7; quick 3)")
    parser.add_argument("--reps", type=int, help="runs per contender per process (5; quick 3)")
    parser.add_argument(
        "--cost-reps",
        type=int,
        default=3,
        help="probed runs per twin, guard on and off (3, odd: a median per call; 0: none)",
    )
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated")
    parser.add_argument(
        "--workloads", default=",".join(sched_workload.WORKLOADS), help="comma-separated"
    )
    args = parser.parse_args(argv)
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
    data = run(args)
    data["summary"] = summarize(data)
    out = launch.save(data, args.out, "scheduler")
    print(markdown(data, data["summary"]))
    print(f"\n(raw results: {out})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
