"""Time the holder audit's screen (``holder_faults``), both twins, by the blocks listed.

Usage and method: bench/README.md. A cache as vLLM's scheduler holds it: requests of 32 blocks
each (the null block first in one of every four, as sliding-window tables have it), a quarter of
them sharing their first 8 blocks with another request (a prefix hit, ``ref_cnt`` 2), every
other block held once; nothing to report. Two reads: ``full`` (every listing, as every
``KVQUEUE_AUDIT_EVERY`` steps) and ``freed`` (the steps between: only the listings of one batch
of 8 freed blocks are read, every other listing compared by address). Each sample is one call;
per size and read, the median of the samples of each process, then the median over
processes, with a bootstrap interval.
"""

from __future__ import annotations

import gc
import random
import sys
from collections import defaultdict
from statistics import median
from time import perf_counter_ns, thread_time_ns
from typing import Any

import launch
from launch import bootstrap_median, interval, short
from screens import Block

SIZES = (1_000, 10_000, 100_000)
PER_REQUEST = 32
SHARED = 8
FREED = 8
# Processes, samples per process and size.
FULL, QUICK = (7, 41), (3, 11)
TWINS = {"cython": "kvqueue.vllm._screen", "python": "kvqueue.vllm._screen_py"}
CLOCKS = {"wall": perf_counter_ns, "cpu": thread_time_ns}


def cache(listed: int, rng: random.Random) -> tuple[list[Block], list[Any]]:
    """A pool and its one manager's ``req_to_blocks``, ``listed`` blocks listed in all."""
    pool = [Block(i) for i in range(listed + 1)]
    pool[0].is_null = True
    free = pool[1:]
    rng.shuffle(free)
    table: dict[str, list[Block]] = defaultdict(list)
    count = 0
    request = 0
    while count < listed:
        want = min(PER_REQUEST, listed - count)
        donor = table.get(f"r{request - 1}", [])
        if request % 4 == 1 and want > SHARED and len(donor) >= SHARED:
            blocks = donor[:SHARED] + [free.pop() for _ in range(want - SHARED)]
        else:
            blocks = [free.pop() for _ in range(want)]
        if request % 4 == 3:
            blocks[0] = pool[0]
        for block in blocks:
            if not block.is_null:
                block.ref_cnt += 1
        table[f"r{request}"] = blocks
        count += len(blocks)
        request += 1
    return pool, [table]


def measure(job: dict[str, Any]) -> dict[str, Any]:
    cpu = launch.pin()
    rng = random.Random(job["seed"])
    clock = CLOCKS[job["clock"]]
    screens = {name: __import__(module, fromlist=["x"]) for name, module in TWINS.items()}
    out: dict[str, Any] = {"cpu": cpu, "sizes": {}}
    for size in SIZES:
        pool, tables = cache(size, rng)
        freed = [rng.sample(pool[1:], FREED)]
        reads = {"full": None, "freed": freed}
        for screen in screens.values():
            assert screen.holder_faults(pool, tables) == []
        runs = [(name, read) for name in screens for read in reads]
        samples: dict[str, list[int]] = {f"{n} {r}": [] for n, r in runs}
        gc.disable()
        try:
            for _ in range(job["samples"]):
                rng.shuffle(runs)
                for name, read in runs:
                    faults, only = screens[name].holder_faults, reads[read]
                    start = clock()
                    faults(pool, tables, only)
                    samples[f"{name} {read}"].append(clock() - start)
        finally:
            gc.enable()
        out["sizes"][str(size)] = {key: median(s) for key, s in samples.items()}
    return out


def main() -> None:
    parser = launch.parser(__doc__, "3 processes")
    parser.add_argument("--cpu-time", action="store_true", help="thread CPU time, not wall")
    args = parser.parse_args()
    processes, samples = QUICK if args.quick else FULL
    clock = "cpu" if args.cpu_time else "wall"
    rng = random.Random(0)
    jobs = [{"label": f"round {i + 1}", "seed": rng.randrange(2**32), "samples": samples,
             "clock": clock} for i in range(processes)]  # fmt: skip
    records = launch.run(measure, jobs)
    data = {"machine": launch.describe(), "clock": clock, "records": records}
    out = launch.save(data, args.out, "audit")
    print(f"The holder audit's screen, µs per call ({clock} time), median of {processes} "
          f"processes x {samples} calls [bootstrap 95% interval]:\n")  # fmt: skip
    print("| listed blocks | read | cython µs | python µs | cython µs per 1,000 listed |")
    print("|---:|---|---:|---:|---:|")
    for size in SIZES:
        per = [r["sizes"][str(size)] for r in records]
        for read in ("full", "freed"):
            c = bootstrap_median([q[f"cython {read}"] / 1e3 for q in per])
            p = bootstrap_median([q[f"python {read}"] / 1e3 for q in per])
            per_k = bootstrap_median([q[f"cython {read}"] / size for q in per])
            print(f"| {size:,} | {read} | {interval(c, 1)} | {interval(p, 0)} "
                  f"| {interval(per_k, 2)} |")  # fmt: skip
    print(f"\nMachine: {short(data['machine'])}.\n(raw results: {out})", file=sys.stderr)


if __name__ == "__main__":
    main()
