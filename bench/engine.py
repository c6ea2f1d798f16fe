"""Engine-level benchmark: vLLM 0.33's real BlockPool on seeded serving traces, per queue.

    python bench/engine.py                 # both traces, 9 fresh processes (about 5 minutes)
    python bench/engine.py --quick         # 3 processes, shorter traces
    python bench/engine.py --profile       # where a step's time goes (cProfile), per queue
    python bench/engine.py --ops           # ns per queue call, by kind, per queue
    python bench/engine.py --processes 15 --reps 7 --out results.json

The block pool is vLLM 0.33.0's own ``BlockPool`` (bench/engine_pool.py), with its
``FreeKVCacheBlockQueue`` swapped for each contender: vLLM 0.30's queue (the reference),
vLLM 0.33's, and kvqueue's ``pure`` and ``cython`` twins. The traces are bench/engine_trace.py's
(decode-heavy, prefix-heavy); their parameters are printed with the table.

Per fresh process (pinned to one CPU, traces in random order, contenders in a new random
order every repetition, the collector off while timing, time measured as the thread's CPU
time so that a shared host's other jobs are not charged) and per trace, it measures:

* step time: the scheduler steps after the warm-up, through the real pool;
* queue time: the same run's queue calls (recorded once), replayed alone on each queue,
  minus the same loop calling a C no-op: the queue's own share of a step;
* block attribute work from Python on ``kvqueue.KVCacheBlock`` vs vLLM's dataclass block.

Each process gives one median per contender; ratios are taken within a process against
``vllm-0.30`` (and ``vllm-0.33``), then summarised as the median over processes with a
percentile-bootstrap 95% interval (bench/stats.py), as bench/run.py does.

``make bench`` does not run this; run it by hand (the vLLM wheels are fetched once by
bench/vllm_source.py). Results go to bench/results/engine-*.json and stdout (Markdown).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import os
import pstats
import random
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import engine_pool
import engine_trace
import machine
import vllm_source
from machine import pin
from stats import bootstrap_median

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
VERSION = "0.33.0"
CONTENDERS = ("vllm-0.30", "vllm-0.33", "pure", "cython")
REFERENCE = "vllm-0.30"
# The thread's CPU time, not the wall clock: on a shared host, time given to other jobs
# between two readings is not charged to the contender (cache pollution still is).
CLOCK = time.thread_time


# -- one fresh process -------------------------------------------------------------------


def queue_classes(engine: engine_pool.Engine) -> dict[str, type]:
    from kvqueue import _queue, _queue_py

    return {
        "vllm-0.30": vllm_source.load_queue_class("0.30.0", engine.KVCacheBlock),
        "vllm-0.33": engine.vllm_queue,
        "pure": _queue_py.FreeKVCacheBlockQueue,
        "cython": _queue.FreeKVCacheBlockQueue,
    }


def trace_params(name: str, quick: bool) -> engine_trace.TraceParams:
    params = engine_trace.TRACES[name]
    if quick:
        params = dataclasses.replace(
            params, steps=params.steps * 2 // 5, warmup_steps=params.warmup_steps * 2 // 5
        )
    return params


def new_pool(engine: engine_pool.Engine, params: engine_trace.TraceParams) -> Any:
    return engine.BlockPool(params.num_blocks, enable_caching=True, hash_block_size=16)


def time_steps(
    engine: engine_pool.Engine, trace: engine_trace.Trace, queue_class: type
) -> tuple[float, dict[str, int]]:
    params = trace.params
    engine.use_queue(queue_class)
    scheduler = engine_trace.Scheduler(trace, new_pool(engine, params))
    gc.collect()
    gc.disable()
    try:
        elapsed = scheduler.timed_run(
            params.warmup_steps, params.steps - params.warmup_steps, CLOCK
        )
    finally:
        gc.enable()
    return elapsed, scheduler.timed_stats


def record_queue_calls(
    engine: engine_pool.Engine, trace: engine_trace.Trace
) -> tuple[engine_trace.QueueLog, int]:
    """The queue calls of one run (with vLLM 0.33's queue), and where the warm-up ends."""
    params = trace.params
    log = engine_trace.QueueLog(engine.vllm_queue)
    engine.use_queue(log)
    scheduler = engine_trace.Scheduler(trace, new_pool(engine, params))
    scheduler.run(params.warmup_steps)
    mark = len(log.ops)
    scheduler.run(params.steps - params.warmup_steps)
    engine.use_queue(engine.vllm_queue)
    return log, mark


def attribute_work(blocks: list[Any], loops: int) -> float:
    """What BlockPool does to a block from Python, per block: its hot attribute reads/writes."""
    start = CLOCK()
    for _ in range(loops):
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                block.ref_cnt += 1
            if block.block_hash is None and block.pool is not None:
                block.ref_cnt -= 1
            block.block_id  # noqa: B018
    return CLOCK() - start


def worker(job: dict[str, Any]) -> dict[str, Any]:
    cpu = pin(job.get("cpu"))
    rng = random.Random(job["seed"])
    engine = engine_pool.load_engine(VERSION)
    queues = queue_classes(engine)
    names = list(CONTENDERS)
    result: dict[str, Any] = {"cpu": cpu, "pid": os.getpid(), "traces": {}}
    traces = list(job["traces"])
    rng.shuffle(traces)
    for trace_name in traces:
        params = trace_params(trace_name, job["quick"])
        trace = engine_trace.make_trace(params, engine)
        log, mark = record_queue_calls(engine, trace)
        steps: dict[str, list[float]] = {n: [] for n in names}
        queue: dict[str, list[float]] = {n: [] for n in names}
        counters: dict[str, int] = {}
        # One untimed run each first: every contender's code and the trace are warm.
        for name in names:
            time_steps(engine, trace, queues[name])
        for _ in range(job["reps"]):
            rng.shuffle(names)
            for name in names:
                elapsed, counters = time_steps(engine, trace, queues[name])
                steps[name].append(elapsed)
            rng.shuffle(names)
            for name in names:
                gc.collect()
                gc.disable()
                try:
                    calls, baseline = engine_trace.replay_queue_ops(
                        log, queues[name], engine.KVCacheBlock, CLOCK, mark
                    )
                finally:
                    gc.enable()
                queue[name].append(calls - baseline)
        timed_ops = log.ops[mark:]
        calls_by_op: dict[str, int] = {}
        for op, _ in timed_ops:
            calls_by_op[op] = calls_by_op.get(op, 0) + 1
        result["traces"][trace_name] = {
            "params": dataclasses.asdict(params),
            "timed_steps": params.steps - params.warmup_steps,
            "counters": counters,
            "queue_calls": calls_by_op,
            "step_s": steps,
            "queue_s": queue,
        }
        engine.use_queue(engine.vllm_queue)
    result["attributes"] = attributes(engine, job["reps"], rng)
    return result


def attributes(engine: engine_pool.Engine, reps: int, rng: random.Random) -> dict[str, list[float]]:
    import kvqueue

    classes = {"vllm-block": engine.KVCacheBlock, "kvqueue-block": kvqueue.KVCacheBlock}
    pools = {name: [cls(i, pool=object()) for i in range(4096)] for name, cls in classes.items()}
    for blocks in pools.values():
        attribute_work(blocks, 5)
    samples: dict[str, list[float]] = {name: [] for name in classes}
    names = list(classes)
    for _ in range(reps * 3):
        rng.shuffle(names)
        for name in names:
            gc.disable()
            samples[name].append(attribute_work(pools[name], 20) / (20 * 4096))
            gc.enable()
    return samples


# -- the parent: processes, summary ---------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    for version in ("0.30.0", VERSION):
        vllm_source.vllm_file(version, engine_pool.UTILS_FILE)  # fetch once, up front
    rng = random.Random(args.seed)
    records = []
    started = time.monotonic()
    for round_ in range(args.processes):
        job = {
            "traces": args.traces,
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
            sys.stderr.write(proc.stderr)
            raise SystemExit(f"engine worker failed (round {round_})")
        records.append(json.loads(proc.stdout))
        print(
            f"[{round_ + 1}/{args.processes}] {time.monotonic() - started:5.0f}s",
            file=sys.stderr,
            flush=True,
        )
    return {
        "machine": machine.describe(),
        "settings": {
            "processes": args.processes,
            "reps": args.reps,
            "quick": args.quick,
            "seed": args.seed,
        },
        "records": records,
    }


def _estimate(values: list[float]) -> tuple[float, float, float]:
    return bootstrap_median(values)


def _fmt(est: tuple[float, float, float], digits: int = 3) -> str:
    return f"{est[0]:.{digits}f} [{est[1]:.{digits}f}, {est[2]:.{digits}f}]"


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    records = data["records"]
    summary: dict[str, Any] = {}
    for trace_name in records[0]["traces"]:
        per = [r["traces"][trace_name] for r in records]
        first = per[0]
        steps = first["timed_steps"]
        c = first["counters"]
        block_ops = c["blocks_allocated"] + c["prefix_hit_blocks"] + c["freed"]
        rows: dict[str, Any] = {}
        for name in CONTENDERS:
            step_med = [median(p["step_s"][name]) for p in per]
            queue_med = [median(p["queue_s"][name]) for p in per]
            ratio = [median(p["step_s"][name]) / median(p["step_s"][REFERENCE]) for p in per]
            vs033 = [median(p["step_s"][name]) / median(p["step_s"]["vllm-0.33"]) for p in per]
            qratio = [median(p["queue_s"][name]) / median(p["queue_s"]["vllm-0.33"]) for p in per]
            share = [median(p["queue_s"][name]) / median(p["step_s"][name]) for p in per]
            rows[name] = {
                "us_per_step": median(step_med) / steps * 1e6,
                "ns_per_block_op": median(step_med) / block_ops * 1e9,
                "queue_us_per_step": median(queue_med) / steps * 1e6,
                "ratio_vs_030": _estimate(ratio),
                "ratio_vs_033": _estimate(vs033),
                "queue_ratio_vs_033": _estimate(qratio),
                "queue_share": _estimate(share),
            }
        summary[trace_name] = {
            "params": first["params"],
            "timed_steps": steps,
            "counters": c,
            "block_ops": block_ops,
            "queue_calls": first["queue_calls"],
            "rows": rows,
        }
    attr_ratio = [
        median(r["attributes"]["kvqueue-block"]) / median(r["attributes"]["vllm-block"])
        for r in records
    ]
    summary["attributes"] = {
        "ns_vllm_block": median(median(r["attributes"]["vllm-block"]) for r in records) * 1e9,
        "ns_kvqueue_block": median(median(r["attributes"]["kvqueue-block"]) for r in records) * 1e9,
        "ratio": _estimate(attr_ratio),
    }
    return summary


def markdown(data: dict[str, Any], summary: dict[str, Any]) -> str:
    settings = data["settings"]
    lines = [
        f"Engine level: vLLM {VERSION}'s `BlockPool` driven by a seeded serving trace, per queue "
        f"(median of {settings['processes']} fresh processes x {settings['reps']} runs, "
        "[bootstrap 95% interval]). Ratios are per-process, against `vllm-0.30`; "
        "*queue* is the queue's own time (the run's queue calls replayed alone), "
        "*share* its part of the step.",
        "",
        "| trace | contender | us/step | ns/block op | vs vllm-0.30 | vs vllm-0.33 "
        "| queue us/step | queue share | queue vs vllm-0.33 |",
        "|---|---|---:|---:|---|---|---:|---|---|",
    ]
    for trace_name, t in summary.items():
        if trace_name == "attributes":
            continue
        for name, row in t["rows"].items():
            lines.append(
                f"| {trace_name} | {name} | {row['us_per_step']:.1f} | "
                f"{row['ns_per_block_op']:.0f} | {_fmt(row['ratio_vs_030'])} | "
                f"{_fmt(row['ratio_vs_033'])} | {row['queue_us_per_step']:.2f} | "
                f"{row['queue_share'][0] * 100:.1f}% | {_fmt(row['queue_ratio_vs_033'])} |"
            )
    a = summary["attributes"]
    lines += [
        "",
        f"Block attribute work from Python (BlockPool's per-block reads and writes): "
        f"vLLM's dataclass block {a['ns_vllm_block']:.1f} ns, kvqueue.KVCacheBlock "
        f"{a['ns_kvqueue_block']:.1f} ns per block; ratio {_fmt(a['ratio'])}.",
        "",
        "Traces:",
    ]
    for trace_name, t in summary.items():
        if trace_name == "attributes":
            continue
        p = t["params"]
        c = t["counters"]
        lines.append(
            f"- {trace_name}: {t['timed_steps']} timed steps after {p['warmup_steps']}; "
            f"per timed step {c['blocks_allocated'] / t['timed_steps']:.1f} blocks allocated in "
            f"{c['get_new_blocks'] / t['timed_steps']:.1f} get_new_blocks calls, "
            f"{c['prefix_hit_blocks'] / t['timed_steps']:.1f} prefix-hit blocks, "
            f"{c['freed'] / t['timed_steps']:.1f} blocks freed; queue calls "
            + ", ".join(f"{op} {n}" for op, n in sorted(t["queue_calls"].items()))
            + f". Parameters: {', '.join(f'{k}={v}' for k, v in p.items())}."
        )
    lines += ["", f"Machine: {machine.short(data['machine'])}."]
    return "\n".join(lines)


# -- profile ---------------------------------------------------------------------------------


def profile(args: argparse.Namespace) -> None:
    pin(args.cpu)
    engine = engine_pool.load_engine(VERSION)
    queues = queue_classes(engine)
    for trace_name in args.traces:
        params = trace_params(trace_name, args.quick)
        trace = engine_trace.make_trace(params, engine)
        for name in ("vllm-0.33", "cython"):
            engine.use_queue(queues[name])
            scheduler = engine_trace.Scheduler(trace, new_pool(engine, params))
            scheduler.run(params.warmup_steps)
            profiler = cProfile.Profile()
            profiler.enable()
            scheduler.run(params.steps - params.warmup_steps)
            profiler.disable()
            stats = pstats.Stats(profiler)
            entries = stats.stats  # type: ignore[attr-defined]
            total = sum(v[2] for v in entries.values())
            rows = sorted(entries.items(), key=lambda kv: kv[1][2], reverse=True)
            print(f"\n## {trace_name}, {name}: tottime by function (cProfile, {total:.3f}s)")
            print("| function | calls | tottime share |")
            print("|---|---:|---:|")
            queue_share = 0.0
            for (filename, line, func), v in rows:
                where = f"{Path(filename).name}:{line}({func})" if line else func
                if "FreeKVCacheBlockQueue" in func or (
                    "kv_cache_utils" in filename and func in _QUEUE_METHODS
                ):
                    queue_share += v[2]
                if v[2] / total >= 0.01:
                    print(f"| `{where}` | {v[1]} | {v[2] / total * 100:.1f}% |")
            print(f"| **queue methods, all** | | **{queue_share / total * 100:.1f}%** |")
        engine.use_queue(engine.vllm_queue)


_QUEUE_METHODS = {"popleft", "popleft_n", "remove", "append", "append_n", "prepend_n"}


def op_breakdown(args: argparse.Namespace) -> None:
    """Per queue call kind: ns per call, replayed alone, each call timed on its own."""
    pin(args.cpu)
    engine = engine_pool.load_engine(VERSION)
    queues = queue_classes(engine)
    clock = time.perf_counter_ns
    for trace_name in args.traces:
        params = trace_params(trace_name, args.quick)
        trace = engine_trace.make_trace(params, engine)
        log, mark = record_queue_calls(engine, trace)
        kinds = sorted({_kind(op, arg) for op, arg in log.ops[mark:]})
        table: dict[str, dict[str, float]] = {}
        for name, queue_class in queues.items():
            per_kind: dict[str, list[int]] = {k: [] for k in kinds}
            for _ in range(5):
                blocks = [engine.KVCacheBlock(i) for i in range(log.num_blocks)]
                queue = queue_class(blocks)
                queue.popleft()
                for index, (op, arg) in enumerate(log.ops[1:], 1):
                    if op == "num_free_blocks":
                        start = clock()
                        queue.num_free_blocks  # noqa: B018
                        elapsed = clock() - start
                    else:
                        value = (
                            blocks[arg]
                            if op in ("remove", "append")
                            else [blocks[i] for i in arg]
                            if op in ("append_n", "prepend_n")
                            else arg
                        )
                        method = getattr(queue, op)
                        start = clock()
                        method(value)
                        elapsed = clock() - start
                    if index >= mark:
                        per_kind[_kind(op, arg)].append(elapsed)
            overhead = median(-clock() + clock() for _ in range(10000))
            table[name] = {k: median(v) - overhead for k, v in per_kind.items() if v}
        counts = {k: sum(1 for op, a in log.ops[mark:] if _kind(op, a) == k) for k in kinds}
        steps = params.steps - params.warmup_steps
        print(f"\n## {trace_name}: median ns per queue call (each timed alone, timer cost off)")
        print("| call | per step | " + " | ".join(queues) + " |")
        print("|---|---:|" + "---:|" * len(queues))
        for kind in kinds:
            cells = " | ".join(f"{table[n].get(kind, 0):.0f}" for n in queues)
            print(f"| {kind} | {counts[kind] / steps:.2f} | {cells} |")
        totals = " | ".join(
            f"{sum(table[n].get(k, 0) * counts[k] for k in kinds) / steps / 1000:.2f}"
            for n in queues
        )
        print(f"| **us per step** | | {totals} |")
        engine.use_queue(engine.vllm_queue)


def _kind(op: str, arg: Any) -> str:
    if op == "popleft_n":
        return "popleft_n(1)" if arg == 1 else "popleft_n(>1)"
    if op in ("append_n", "prepend_n"):
        return f"{op}(1)" if len(arg) == 1 else f"{op}(>1)"
    return op


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="3 processes, shorter traces")
    parser.add_argument("--profile", action="store_true", help="cProfile breakdown instead")
    parser.add_argument("--ops", action="store_true", help="ns per queue call kind instead")
    parser.add_argument("--processes", type=int, help="fresh processes (9; quick 3)")
    parser.add_argument("--reps", type=int, help="runs per contender per process (5; quick 3)")
    parser.add_argument("--traces", default=",".join(engine_trace.TRACES), help="comma-separated")
    parser.add_argument("--cpu", type=int, help="pin to this CPU (default: the last allowed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/...)")
    parser.add_argument("--summarize", type=Path, help="re-tabulate a results JSON")
    args = parser.parse_args(argv)
    if args.worker:
        json.dump(worker(json.loads(args.worker)), sys.stdout)
        return
    args.traces = args.traces.split(",")
    if args.summarize:
        data = json.loads(args.summarize.read_text())
        print(markdown(data, summarize(data)))
        return
    if args.profile:
        profile(args)
        return
    if args.ops:
        op_breakdown(args)
        return
    args.processes = args.processes or (3 if args.quick else 9)
    args.reps = args.reps or (3 if args.quick else 5)
    data = run(args)
    out = args.out or RESULTS / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    data["summary"] = summarize(data)
    out.write_text(json.dumps(data, indent=1))
    print(markdown(data, data["summary"]))
    print(f"\n(raw results: {out})", file=sys.stderr)


if __name__ == "__main__":
    main()
