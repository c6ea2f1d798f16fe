"""Engine-level benchmark on vLLM's real scheduler: vLLM 0.33.0's own queue vs kvqueue's twins.

    make bench-scheduler                        # the vLLM venv, full run (about 20 minutes)
    python bench/scheduler.py --quick           # 3 processes, shorter workloads
    python bench/scheduler.py --summarize bench/results/scheduler-....json

Runs in a venv holding vLLM 0.33.0 and kvqueue (vllm_tests/venv.sh makes it). vLLM's own
``Scheduler`` (bench/sched_engine.py: its real KVCacheManager and BlockPool, on the CPU,
a fake model) serves the seeded workloads of bench/sched_workload.py (decode-heavy,
prefix-heavy). Contenders: ``vllm`` (vLLM's own FreeKVCacheBlockQueue), ``cython`` and
``python`` (``kvqueue.vllm.install("cython" / "python")`` before the scheduler is built).

Per fresh process (pinned to one CPU, workloads in random order) and per workload:

* step time: the thread CPU time inside ``schedule()`` + ``update_from_output()`` over the
  timed steps (after a warm-up that fills the cache), one untimed run per contender first,
  then ``--reps`` runs with the contenders in a new random order each time, the collector
  off while timing. Every run must schedule exactly the same requests, tokens and block ids
  as the first (a fingerprint per run), or the process fails;
* queue time: the queue calls of one run (recorded on vLLM's queue) replayed alone on a
  fresh queue of each contender, minus the same loop making no call (bench/engine_trace.py's
  recorder and replay);
* shares: ``--reps`` more runs per contender under a CPU-clock sampling profiler
  (bench/sched_probe.py): the part of the step in vLLM's KV-cache manager, in the block
  pool and (for queues written in Python) in the queue.

Ratios are taken within a process against ``vllm``, then the median over processes with a
percentile-bootstrap 95% interval (bench/stats.py). Results: bench/results/scheduler-*.json
and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CONTENDERS = ("vllm", "cython", "python")
REFERENCE = "vllm"
CLOCK = time.thread_time
SAMPLE_INTERVAL_S = 0.001


# -- one fresh process -------------------------------------------------------------------


def use(name: str) -> type:
    """Bind vLLM's pool to contender ``name``'s queue; return the class its pools will hold."""
    from vllm.v1.core import block_pool

    import kvqueue.vllm

    if name == REFERENCE:
        kvqueue.vllm.uninstall()
        queue_class: type = block_pool.FreeKVCacheBlockQueue
        return queue_class
    return kvqueue.vllm.install(name)  # type: ignore[arg-type]


def shrink(w: Any, quick: bool) -> Any:
    if not quick:
        return w
    return dataclasses.replace(w, steps=w.steps // 2, warmup_steps=w.warmup_steps // 2)


def timed_run(driver: Any, w: Any) -> float:
    gc.collect()
    gc.disable()
    try:
        driver.run(w.warmup_steps, CLOCK)
        return float(driver.run(w.steps - w.warmup_steps, CLOCK))
    finally:
        gc.enable()


def run_contender(name: str, factory: Any, specs: list[Any], w: Any, reference: int) -> float:
    """One timed run on contender ``name``'s queue; it must schedule what vLLM's queue did."""
    import sched_engine

    queue_class = use(name)
    driver = sched_engine.Driver(factory, specs)
    assert type(sched_engine.block_pool(driver.scheduler).free_block_queue) is queue_class, name
    elapsed = timed_run(driver, w)
    if driver.fingerprint != reference:
        raise SystemExit(f"{name}: the schedule differs from the one on vLLM's own queue")
    return elapsed


def record_queue_calls(factory: Any, specs: list[Any], w: Any) -> dict[str, Any]:
    """One run on vLLM's queue with its calls logged; evictions counted on the side."""
    import engine_trace
    import sched_engine
    from vllm.v1.core import block_pool

    original = use(REFERENCE)
    log = engine_trace.QueueLog(original)
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
        mark, evicted_warmup = len(log.ops), evicted[0]
        before = dict(driver.counters)
        driver.run(w.steps - w.warmup_steps, CLOCK)
    finally:
        block_pool.FreeKVCacheBlockQueue = original  # type: ignore[attr-defined]
        block_pool.BlockPool._maybe_evict_cached_block = evict  # type: ignore[method-assign]
    counters = {k: v - before[k] for k, v in driver.counters.items()}
    counters["evicted_blocks"] = evicted[0] - evicted_warmup
    calls: dict[str, int] = {}
    for op, arg in log.ops[mark:]:
        calls[op] = calls.get(op, 0) + 1
        if op == "popleft_n":
            calls["blocks_allocated"] = calls.get("blocks_allocated", 0) + arg
    return {
        "log": log,
        "mark": mark,
        "counters": counters,
        "queue_calls": calls,
        "fingerprint": driver.fingerprint,
    }


def sampled_shares(driver: Any, w: Any, queue_classes: list[type]) -> dict[str, int]:
    import sched_probe
    from vllm.v1.core.sched.scheduler import Scheduler

    step_codes = {Scheduler.schedule.__code__, Scheduler.update_from_output.__code__}
    sampler = sched_probe.Sampler(
        SAMPLE_INTERVAL_S, step_codes, sched_probe.method_codes(*queue_classes)
    )
    driver.run(w.warmup_steps, CLOCK)
    gc.collect()
    gc.disable()
    try:
        with sampler:
            driver.run(w.steps - w.warmup_steps, CLOCK)
    finally:
        gc.enable()
    return sampler.counts


def worker(job: dict[str, Any]) -> dict[str, Any]:
    from machine import pin

    cpu = pin(job.get("cpu"))
    import engine_trace
    import sched_engine
    import sched_workload
    from vllm.v1.core import kv_cache_utils

    import kvqueue._queue_py

    rng = random.Random(job["seed"])
    model = sched_engine.model_dir()
    python_queues = [kv_cache_utils.FreeKVCacheBlockQueue, kvqueue._queue_py.FreeKVCacheBlockQueue]
    result: dict[str, Any] = {"cpu": cpu, "pid": os.getpid(), "workloads": {}}
    names = list(job["workloads"])
    rng.shuffle(names)
    for wname in names:
        w = shrink(sched_workload.WORKLOADS[wname], job["quick"])
        specs = sched_workload.make_workload(w)
        factory = sched_engine.SchedulerFactory(w, model)
        recorded = record_queue_calls(factory, specs, w)
        reference = recorded["fingerprint"]
        queues = {name: use(name) for name in CONTENDERS}
        contenders = list(CONTENDERS)

        for name in contenders:  # untimed: every contender's code and data warm
            run_contender(name, factory, specs, w, reference)
        steps: dict[str, list[float]] = {n: [] for n in CONTENDERS}
        for _ in range(job["reps"]):
            rng.shuffle(contenders)
            for name in contenders:
                steps[name].append(run_contender(name, factory, specs, w, reference))
        queue: dict[str, list[float]] = {n: [] for n in CONTENDERS}
        for _ in range(job["reps"]):
            rng.shuffle(contenders)
            for name in contenders:
                gc.collect()
                gc.disable()
                try:
                    calls, baseline = engine_trace.replay_queue_ops(
                        recorded["log"],
                        queues[name],
                        kv_cache_utils.KVCacheBlock,
                        CLOCK,
                        recorded["mark"],
                    )
                finally:
                    gc.enable()
                queue[name].append(calls - baseline)
        samples: dict[str, dict[str, int]] = {}
        for _ in range(job["reps"]):
            rng.shuffle(contenders)
            for name in contenders:
                use(name)
                driver = sched_engine.Driver(factory, specs)
                counts = sampled_shares(driver, w, python_queues)
                total = samples.setdefault(name, dict.fromkeys(counts, 0))
                for key, value in counts.items():
                    total[key] += value
        use(REFERENCE)
        result["workloads"][wname] = {
            "params": dataclasses.asdict(w),
            "timed_steps": w.steps - w.warmup_steps,
            "requests": len(specs),
            "counters": recorded["counters"],
            "queue_calls": recorded["queue_calls"],
            "step_s": steps,
            "queue_s": queue,
            "samples": samples,
        }
    return result


# -- the parent: processes, summary ---------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    import machine

    rng = random.Random(args.seed)
    records = []
    started = time.monotonic()
    for round_ in range(args.processes):
        job = {
            "workloads": args.workloads,
            "seed": rng.randrange(2**32),
            "reps": args.reps,
            "quick": args.quick,
            "cpu": args.cpu,
        }
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode:
            sys.stderr.write(proc.stderr[-5000:])
            raise SystemExit(f"scheduler worker failed (round {round_})")
        records.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(
            f"[{round_ + 1}/{args.processes}] {time.monotonic() - started:5.0f}s",
            file=sys.stderr,
            flush=True,
        )
    return {
        "machine": machine.describe(),
        "vllm": _vllm_version(),
        "settings": {
            "processes": args.processes,
            "reps": args.reps,
            "quick": args.quick,
            "seed": args.seed,
            "sample_interval_s": SAMPLE_INTERVAL_S,
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
    summary: dict[str, Any] = {}
    for wname in records[0]["workloads"]:
        per = [r["workloads"][wname] for r in records]
        steps = per[0]["timed_steps"]
        rows: dict[str, Any] = {}
        for name in CONTENDERS:
            step_med = [median(p["step_s"][name]) for p in per]
            queue_med = [median(p["queue_s"][name]) for p in per]
            ratio = [median(p["step_s"][name]) / median(p["step_s"][REFERENCE]) for p in per]
            qratio = [median(p["queue_s"][name]) / median(p["queue_s"][REFERENCE]) for p in per]
            qshare = [median(p["queue_s"][name]) / median(p["step_s"][name]) for p in per]
            # Sampled shares: ticks pooled over all runs of all processes.
            ticks = {k: sum(p["samples"][name][k] for p in per) for k in per[0]["samples"][name]}
            rows[name] = {
                "us_per_step": median(step_med) / steps * 1e6,
                "step_ratio": bootstrap_median(ratio),
                "queue_us_per_step": median(queue_med) / steps * 1e6,
                "queue_ratio": bootstrap_median(qratio),
                "queue_share": bootstrap_median(qshare),
                "sampled": ticks,
                "kv_manager_share": ticks["kv_manager"] / ticks["step"],
                "pool_share": ticks["pool"] / ticks["step"],
                "sampled_queue_share": ticks["queue"] / ticks["step"],
                "process_spread": max(step_med) / min(step_med),
            }
        summary[wname] = {
            "params": per[0]["params"],
            "timed_steps": steps,
            "requests": per[0]["requests"],
            "counters": per[0]["counters"],
            "queue_calls": per[0]["queue_calls"],
            "rows": rows,
        }
    return summary


def _fmt(est: list[float] | tuple[float, float, float], digits: int = 3) -> str:
    return f"{est[0]:.{digits}f} [{est[1]:.{digits}f}, {est[2]:.{digits}f}]"


def markdown(data: dict[str, Any], summary: dict[str, Any]) -> str:
    import machine

    s = data["settings"]
    lines = [
        f"vLLM {data['vllm']}'s `Scheduler` on the CPU (fake model), per queue: median of "
        f"{s['processes']} fresh processes x {s['reps']} runs, [bootstrap 95% interval]. "
        "*step*: thread CPU time of `schedule()` + `update_from_output()`; *queue*: the run's "
        "queue calls replayed alone; *KV mgr / pool / queue (sampled)*: share of step CPU "
        "ticks with vLLM's KV-cache manager / `BlockPool` / a Python-level queue method on "
        "the stack (`-`: compiled, invisible to the sampler).",
        "",
        "| workload | queue | µs/step | step vs vllm | queue µs/step | queue share "
        "| queue vs vllm | KV mgr (sampled) | pool (sampled) | queue (sampled) |",
        "|---|---|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    for wname, t in summary.items():
        for name, row in t["rows"].items():
            sampled_queue = "-" if name == "cython" else f"{row['sampled_queue_share'] * 100:.1f}%"
            lines.append(
                f"| {wname} | {name} | {row['us_per_step']:.0f} | {_fmt(row['step_ratio'])} | "
                f"{row['queue_us_per_step']:.2f} | {row['queue_share'][0] * 100:.2f}% | "
                f"{_fmt(row['queue_ratio'])} | {row['kv_manager_share'] * 100:.1f}% | "
                f"{row['pool_share'] * 100:.1f}% | {sampled_queue} |"
            )
    lines += ["", "Workloads (per timed step, from the recorded run on vLLM's queue):"]
    for wname, t in summary.items():
        n = t["timed_steps"]
        c = t["counters"]
        q = t["queue_calls"]
        ticks = t["rows"][REFERENCE]["sampled"]["step"]
        lines.append(
            f"- {wname}: {t['requests']} requests, {n} timed steps after "
            f"{t['params']['warmup_steps']}; per step {c['scheduled_tokens'] / n:.0f} tokens "
            f"scheduled, {c['admitted'] / n:.2f} requests admitted, {c['finished'] / n:.2f} "
            f"finished, {c['preempted'] / n:.3f} preempted; "
            f"{q.get('blocks_allocated', 0) / n:.1f} blocks allocated "
            f"({c['evicted_blocks'] / n:.1f} evicted from the prefix cache); queue calls "
            + ", ".join(
                f"{op} {k / n:.1f}" for op, k in sorted(q.items()) if op != "blocks_allocated"
            )
            + f"; {ticks} sampled ticks in steps (vllm)."
        )
    lines += [
        "",
        f"Machine: {machine.short(data['machine'])}; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in data['loadavg'])}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import sched_workload

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="3 processes, half the steps")
    parser.add_argument("--processes", type=int, help="fresh processes (7; quick 3)")
    parser.add_argument("--reps", type=int, help="runs per contender per process (5; quick 3)")
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
        return
    args.workloads = args.workloads.split(",")
    if args.summarize:
        data = json.loads(args.summarize.read_text())
        print(markdown(data, summarize(data)))
        return
    args.processes = args.processes or (3 if args.quick else 7)
    args.reps = args.reps or (3 if args.quick else 5)
    data = run(args)
    out = args.out or RESULTS / f"scheduler-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    data["summary"] = summarize(data)
    out.write_text(json.dumps(data, indent=1))
    print(markdown(data, data["summary"]))
    print(f"\n(raw results: {out})", file=sys.stderr)


if __name__ == "__main__":
    main()
