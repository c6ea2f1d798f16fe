"""One fresh process timing one case: ``python bench/worker.py JSON`` prints a JSON result.

Run by ``run.py`` (through launch.py), once per case per round. The process builds its
contenders' states, calibrates a loop count on the reference, warms every contender up with
the same cycles, then checks that they all hold the same order (a wrong queue is not timed),
and takes the samples with the contender order shuffled in every sample.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
from time import perf_counter_ns
from typing import Any

import cases
import contenders
from launch import pin


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
    cpu = pin(job.get("cpu"))
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
    if any(order != orders[reference] for order in orders.values()):
        wrong = [name for name, order in orders.items() if order != orders[reference]]
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
        "case": case.key,
        "name": case.name,
        "pool": case.pool,
        "cycle": case.cycle,
        "round": job["round"],
        "seed": job["seed"],
        "cpu": cpu,
        "pid": os.getpid(),
        "loops": loops,
        "orders": shuffles,
        "samples_ns": samples,
    }


if __name__ == "__main__":
    json.dump(measure(json.loads(sys.argv[1])), sys.stdout)
