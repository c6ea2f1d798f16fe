"""Benchmark kvqueue's twins against vLLM's own FreeKVCacheBlockQueue and collections.deque.

Usage and method: bench/README.md. Each case runs in fresh processes of this script
(``--worker``); the Markdown tables go to stdout, the raw samples to a JSON file and the ratio
chart to a PNG beside it. It times whatever ``kvqueue`` imports.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from time import perf_counter_ns
from typing import Any

import cases
import chart
import contenders
import launch
import report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = launch.parser(
        __doc__, "fresh processes per case (11; quick 3)", "smoke test: small, no vLLM"
    )
    parser.add_argument("--samples", type=int, help="samples per process (9; quick 5)")
    parser.add_argument("--sample-ms", type=float, help="reference time per sample (20; quick 2)")
    parser.add_argument("--contenders", help=f"comma-separated, from {','.join(contenders.ALL)}")
    parser.add_argument("--only", help="run only the cases whose key contains this text")
    parser.add_argument("--no-download", action="store_true", help="skip vLLM not cached")
    parser.add_argument("--baseline", metavar="REV", help="also time the twins at git REV")
    args = parser.parse_args(argv)
    if args.worker:
        return args
    defaults = (3, 5, 2.0) if args.quick else (11, 9, 20.0)
    args.processes = args.processes or defaults[0]
    args.samples = args.samples or defaults[1]
    args.sample_ms = args.sample_ms or defaults[2]
    chosen = contenders.QUICK if args.quick else contenders.ALL
    args.contenders = args.contenders.split(",") if args.contenders else list(chosen)
    if args.baseline:
        try:
            args.baseline = contenders.resolve(args.baseline)
        except LookupError as exc:
            raise SystemExit(f"--baseline: {exc}") from exc
        # Each twin's old build just before it: the table reads old, new.
        args.contenders = [
            run
            for name in args.contenders
            for run in ((f"{name}@{args.baseline}", name) if name in contenders.TWINS else (name,))
        ]
    return args


# -- one fresh process: one case, every contender


def timed(bench: cases.Bench, loops: int) -> int:
    bench.prepare()
    # As timeit does: a collection landing in one sample would be charged to one contender.
    gc.disable()
    start = perf_counter_ns()
    bench.run(loops)
    elapsed = perf_counter_ns() - start
    gc.enable()
    return elapsed


def calibrate(bench: cases.Bench, target_ns: int) -> tuple[int, int]:
    """Loops for one sample of about ``target_ns`` on ``bench``; also the cycles spent."""
    loops, spent = 1, 0
    while True:
        elapsed = timed(bench, loops)
        spent += loops
        if elapsed >= target_ns:
            return loops, spent
        loops *= 2 if elapsed < target_ns / 4 else 1 + int(target_ns / max(elapsed, 1))


def measure(job: dict[str, Any]) -> dict[str, Any]:
    cpu = launch.pin(job.get("cpu"))
    case = next(c for c in cases.all_cases() if c.key == job["case"])
    rng = random.Random(job["seed"])
    names = list(job["contenders"])
    loaded = {name: contenders.load(name, download=False) for name in names}
    rng.shuffle(names)
    benches = {}
    for name in names:
        # The same seed for all: every contender walks the same shuffled orders.
        bench = case.build(loaded[name], case.pool, random.Random(job["seed"]))
        if bench is not None:
            benches[name] = bench
    gc.collect()
    gc.freeze()  # the pools are permanent: no later collection walks them

    reference = job["reference"]
    if case.single_shot:
        loops, spent = 1, 0
    else:
        loops, spent = calibrate(benches[reference], job["target_ns"])
    orders = {}
    for name, bench in benches.items():
        if name != reference and spent:
            bench.run(spent)
        timed(bench, loops)
        orders[name] = bench.ids()
    wrong = [name for name, order in orders.items() if order != orders[reference]]
    if wrong:
        raise SystemExit(f"{case.key}: {wrong} disagree with {reference}: a wrong queue")

    samples: dict[str, list[float]] = {name: [] for name in benches}
    shuffles = []
    for _ in range(job["samples"]):
        order = list(benches)
        rng.shuffle(order)
        shuffles.append(order)
        for name in order:
            samples[name].append(timed(benches[name], loops) / loops)
    return {
        "case": case.key, "name": case.name, "pool": case.pool, "cycle": case.cycle,
        "round": job["round"], "seed": job["seed"], "cpu": cpu, "pid": os.getpid(),
        "loops": loops, "orders": shuffles, "samples_ns": samples,
    }  # fmt: skip


# -- the parent


def bench(args: argparse.Namespace) -> dict[str, Any]:
    names, skipped = [], {}
    for name in args.contenders:
        try:
            contenders.load(name, download=not (args.quick or args.no_download))
        except LookupError as exc:
            skipped[name] = str(exc)
            print(f"skipping {name}: {exc}", file=sys.stderr)
            continue
        names.append(name)
    fallback = contenders.FALLBACK_REFERENCE
    reference = contenders.REFERENCE if contenders.REFERENCE in names else fallback
    if reference not in names:
        raise SystemExit(f"no reference: neither {contenders.REFERENCE} nor {fallback} loads")
    selected = cases.all_cases()
    if args.quick:
        # The small pool and the 100k build keep the smoke test well under a minute.
        selected = [c for c in selected if c.pool == cases.SMALL_POOL or c.single_shot]
        selected = [c for c in selected if c.pool <= cases.LARGE_POOL]
    if args.only:
        selected = [c for c in selected if args.only in c.key]
    rng = random.Random(args.seed)
    jobs = []
    for round_ in range(args.processes):
        order = list(selected)
        rng.shuffle(order)
        jobs += [
            {"case": case.key, "round": round_, "seed": rng.randrange(2**32),
             "contenders": names, "reference": reference, "samples": args.samples,
             "target_ns": int(args.sample_ms * 1e6), "cpu": args.cpu}
            for case in order
        ]  # fmt: skip
    # Described first: the checkout may move on during a long run.
    described = launch.describe()
    started = time.time()
    records = launch.run(__file__, jobs, lambda job: f"round {job['round'] + 1} {job['case']}")
    settings = {
        "reference": reference, "contenders": names, "skipped": skipped,
        "cases": [case.key for case in selected],
        **{k: vars(args)[k] for k in ("processes", "samples", "sample_ms", "seed", "quick",
                                      "baseline")},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
    }  # fmt: skip
    return {"machine": described, "settings": settings, "records": records}


def publish(results: dict[str, Any], path: Path) -> None:
    print(report.table(results))
    if results["settings"]["reference"] == contenders.REFERENCE:
        print("\n" + report.targets(results))
    if report.baseline_pairs(results):
        print("\n" + report.versus(results))
    print(f"\nraw samples: {path}", file=sys.stderr)
    try:
        chart.draw(results, path.with_suffix(".png"))
    except ImportError:
        print(
            "chart skipped: matplotlib is missing (pip install 'kvqueue[bench]')", file=sys.stderr
        )
    else:
        print(f"chart: {path.with_suffix('.png')}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
    elif args.summarize:
        publish(json.loads(args.summarize.read_text(encoding="utf-8")), args.summarize)
    else:
        results = bench(args)
        kind = "quick" if args.quick else "full"
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        publish(results, launch.save(results, args.out, f"{stamp}-{platform.node()}-{kind}"))


if __name__ == "__main__":
    main()
