"""Time the pool guard's compiled screen of vLLM's free path against its build at another revision.

Usage and method: bench/README.md. The screen is what every ``free_blocks`` batch passes on the
guard's passing path (the guard's most frequent screen by blocks, and one that keeps a table of
what it counted): ``passes_free`` without a holder index where a build has it, else the
``first_excess`` it replaced, which checks the same. A case is a batch of distinct blocks of one
pool, each holding one reference, as a request's blocks come back. It times whatever
``kvqueue.vllm._screen`` imports against ``_screen`` at REV.
"""

from __future__ import annotations

import gc
import random
import sys
from dataclasses import dataclass, field
from statistics import median
from time import perf_counter_ns, thread_time_ns
from typing import Any

import contenders
import launch
from launch import bootstrap_median, interval, short

# Processes, samples per process, the current build's time per sample (ms).
FULL, QUICK = (11, 9, 20.0), (3, 5, 2.0)
POOL = 4_096
BATCHES = (1, 16, 128)
CLOCKS = {"wall": perf_counter_ns, "cpu": thread_time_ns}


@dataclass(slots=True)
class Block:
    """vLLM 0.33's ``KVCacheBlock``'s fields, laid out as its ``@dataclass(slots=True)``."""

    block_id: int
    ref_cnt: int = 0
    pool: Any = field(default=None, repr=False)
    _block_hash: Any = None
    _block_hash_num_tokens: int | None = None
    prev_free_block: Block | None = None
    next_free_block: Block | None = None
    is_null: bool = False


def _screen(name: str) -> tuple[Any, tuple[Any, ...], Any]:
    """The build's free-path screen, what it is called with after ``(batch, pool)``, and what
    it returns for a batch it passes."""
    rev = name.partition("@")[2]
    module = contenders.baseline_module(rev, "_screen") if rev else "kvqueue.vllm._screen"
    screens = __import__(module, fromlist=["first_excess"])
    if hasattr(screens, "passes_free"):
        return screens.passes_free, (None, None), True
    return screens.first_excess, (), -1


def measure(job: dict[str, Any]) -> dict[str, Any]:
    cpu = launch.pin()
    rng = random.Random(job["seed"])
    clock = CLOCKS[job["clock"]]
    screens = {name: _screen(name) for name in job["contenders"]}
    owner = object()
    blocks = [Block(i, ref_cnt=1, pool=owner) for i in range(POOL)]
    rng.shuffle(blocks)
    batch = blocks[: job["batch"]]
    for name, (screen, extra, passed) in screens.items():
        if screen(batch, owner, *extra) != passed:
            raise SystemExit(f"{name}: {screen.__name__} found a misuse in a valid batch")
    gc.collect()
    gc.freeze()

    def timed(called: tuple[Any, tuple[Any, ...], Any], loops: int) -> int:
        screen, extra, _ = called
        started = clock()
        for _ in range(loops):
            screen(batch, owner, *extra)
        return clock() - started

    current = screens[job["contenders"][-1]]
    loops = 1
    while timed(current, loops) < job["target_ns"] / 10:
        loops *= 2
    loops = max(1, loops * job["target_ns"] // max(1, timed(current, loops)))
    for screen in screens.values():
        timed(screen, loops)
    samples: dict[str, list[float]] = {name: [] for name in screens}
    gc.disable()
    for _ in range(job["samples"]):
        order = list(screens)
        rng.shuffle(order)
        for name in order:
            samples[name].append(timed(screens[name], loops) / loops)
    gc.enable()
    return {"batch": job["batch"], "cpu": cpu, "loops": loops, "samples_ns": samples}


def main() -> None:
    parser = launch.parser(__doc__, "smoke test: 3 processes, short samples")
    parser.add_argument("--baseline", metavar="REV", required=True, help="the build to compare")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time by the thread's CPU time, not the wall clock"
    )
    args = parser.parse_args()
    try:
        old = f"cython@{contenders.resolve(args.baseline)}"
    except LookupError as exc:
        raise SystemExit(f"--baseline: {exc}") from exc
    names = [old, "cython"]
    _screen(old)  # built here, once, not in every worker
    processes, samples, sample_ms = QUICK if args.quick else FULL
    clock = "cpu" if args.cpu_time else "wall"
    rng = random.Random(0)
    jobs = [
        {"batch": batch, "label": f"round {round_ + 1} free screen x{batch}",
         "seed": rng.randrange(2**32), "contenders": names, "samples": samples, "clock": clock,
         "target_ns": int(sample_ms * 1e6)}
        for round_ in range(processes)
        for batch in rng.sample(BATCHES, len(BATCHES))
    ]  # fmt: skip
    described = launch.describe()
    records = launch.run(measure, jobs)
    results = {
        "machine": described,
        "settings": {"contenders": names, "baseline": old, "clock": clock,
                     "processes": processes, "samples": samples, "sample_ms": sample_ms},
        "records": records,
    }  # fmt: skip
    path = launch.save(results, args.out, "screens")
    kinds = {n: _screen(n)[0].__name__ for n in names}
    print(
        f"The compiled screen of `free_blocks`' passing path (`cython`: `{kinds['cython']}`; "
        f"`{old}`: `{kinds[old]}`), `cython` against `{old}` "
        f"(median of {processes} processes x {samples} samples, [bootstrap 95% interval]) · "
        f"median time per call. Timed by the {'thread CPU time' if clock == 'cpu' else 'wall'}"
        f" clock.\n{short(described)}\n"
    )
    print(f"| blocks freed | `{old}` | `cython` | `cython` / `{old}` |\n|---:|---:|---:|---:|")
    for batch in BATCHES:
        mine = [r for r in records if r["batch"] == batch]
        times = {n: median(median(r["samples_ns"][n]) for r in mine) for n in names}
        ratios = [median(r["samples_ns"]["cython"]) / median(r["samples_ns"][old]) for r in mine]
        print(
            f"| {batch} | {times[old]:,.0f} ns | {times['cython']:,.0f} ns "
            f"| {interval(bootstrap_median(ratios))} |"
        )
    print(f"\nraw samples: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
