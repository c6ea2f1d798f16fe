"""kvqueue's cost on vLLM's real scheduler by the size of the cache it holds.

Usage and method: bench/README.md; runs in the venv of vllm_tests/venv.sh. vLLM's ``Scheduler``
(sched_engine.py) holds about 1,000, 10,000, 100,000 and 400,000 listed blocks: running requests
of 488 prompt tokens and 50 output tokens (30.5 to 33.6 blocks of 16 each, about 32 listed), a
pool 6% above the most they list, no prefix shared. At step 0 the whole batch is admitted, its
outputs staggered so that a fiftieth of it finishes at each step; from step 1 as many new requests
arrive as finish. Past the warm-up every step is a decode step for all but the 2% just admitted,
whose prefill it schedules too.

Contenders: ``vllm`` (vLLM alone), ``cython+guard`` and ``python+guard``
(``kvqueue.vllm.install(twin)``, pool guard on, default settings; ``KVQUEUE_AUDIT_EVERY`` set,
the holder audit reads every listing every that many steps, a stall the largest added step
shows). Per size, each fresh process (pinned to one CPU, the collector off) first runs vLLM
alone once with its queue's calls counted (the blocks moved in and out of the free list, the
schedule's fingerprint, the pool it leaves), then ``reps`` timed runs per contender, in a new
random order each round; each must schedule what vLLM alone did and leave the same pool, or
the process fails. A step is the thread CPU time of ``schedule()`` +
``update_from_output()``; the audit's own time is timed around each ``read_holders`` call (a
step with nothing to read, which the step guard passes itself in O(1), is not timed).

Per process and contender: the median step (the median over runs of each run's median step);
the added time per step (the total over the timed steps less vLLM alone's, each the median over
runs, per step: the full reads are in it); the largest added step (per step, the median over runs
less vLLM alone's, at most). Then the median over processes, with a bootstrap 95% interval for
the ratios.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from statistics import median
from typing import Any, overload
from unittest.mock import patch

import launch
import sched_engine
from launch import bootstrap_median, interval
from sched_engine import Spec
from scheduler import pool_state, use

import kvqueue.vllm
from kvqueue.vllm import _audit

SIZES = (1_000, 10_000, 100_000, 400_000)
QUICK_SIZES = SIZES[:3]
CONTENDERS = ("vllm", "cython+guard", "python+guard")
REFERENCE = "vllm"
BLOCK_SIZE = 16
PROMPT_TOKENS = 488
LIFETIME = 50  # steps a request decodes: 1/50 of the batch is replaced each step
# The blocks a request lists over its life, on average; the pool holds the most plus 6%.
MEAN_BLOCKS = sum(math.ceil((PROMPT_TOKENS + k) / BLOCK_SIZE) for k in range(LIFETIME)) / LIFETIME
MOST_BLOCKS = math.ceil((PROMPT_TOKENS + LIFETIME) / BLOCK_SIZE)
HEADROOM = 1.06
# The batch has all finished its first life by step LIFETIME; the audit's first full read is at
# step 0, so a warm-up of 64 steps puts a full read every KVQUEUE_AUDIT_EVERY=64 steps at the
# first timed step of each 64.
WARMUP_STEPS = 64
# Timed steps (full, quick): multiples of 64, so each run holds its share of full reads. The
# largest size is slow on the pure twin: fewer steps.
TIMED_STEPS = {1_000: (256, 128), 10_000: (256, 128), 100_000: (128, 64), 400_000: (64, 64)}
# Processes, runs per contender per process (full, quick).
ROUNDS = {False: (3, 3), True: (2, 2)}
# At most this many runs per contender per process: a run at 400,000 takes 2-3 minutes.
MOST_REPS = {400_000: 1}  # whatever --reps says


class Requests(Sequence[Spec]):
    """A run's requests in arrival order, each built when read (a full run holds tens of
    thousands of prompts). Each prompt's first block is its own, so no two share a prefix."""

    def __init__(self, batch: int, steps: int) -> None:
        self.batch = batch
        # Arrivals of step s: as many as finish at s, a fiftieth of the batch (spread evenly).
        self._arrival_steps = [0] * batch + [
            s for s in range(1, steps) for _ in range(self._arriving(s))
        ]
        self._tail = [7 + (i % 1000) for i in range(PROMPT_TOKENS - BLOCK_SIZE)]

    def _arriving(self, step: int) -> int:
        return step * self.batch // LIFETIME - (step - 1) * self.batch // LIFETIME

    def output_tokens(self, i: int) -> int:
        """The batch's outputs are staggered from 1 to LIFETIME; every later request's is
        LIFETIME."""
        return 1 + i * LIFETIME // self.batch if i < self.batch else LIFETIME

    def __len__(self) -> int:
        return len(self._arrival_steps)

    @overload
    def __getitem__(self, i: int) -> Spec: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Spec]: ...
    def __getitem__(self, i: int | slice) -> Spec | Sequence[Spec]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        head = [1000 + (i >> (10 * k)) % 1024 for k in range(BLOCK_SIZE)]
        return Spec(f"req-{i}", self._arrival_steps[i], head + self._tail, self.output(i))

    def output(self, i: int) -> list[int]:
        return [3] * self.output_tokens(i)


def workload(listed: int, timed_steps: int) -> tuple[sched_engine.Workload, Requests]:
    """The scheduler's settings and the requests that keep about ``listed`` blocks listed."""
    batch = max(1, round(listed / MEAN_BLOCKS))
    steps = WARMUP_STEPS + timed_steps
    requests = Requests(batch, steps)
    # Step 0 prefills the whole batch at once; later steps, a fiftieth of it beside the decodes.
    budget = batch * PROMPT_TOKENS + batch
    w = dataclasses.replace(
        sched_engine.DECODE_HEAVY, name=f"scale-{listed}", steps=steps, warmup_steps=WARMUP_STEPS,
        num_blocks=math.ceil(batch * MOST_BLOCKS * HEADROOM) + 1, block_size=BLOCK_SIZE,
        arrivals_per_step=0.0, max_num_seqs=batch + requests._arriving(1) + 1,
        max_num_batched_tokens=max(budget, sched_engine.MAX_MODEL_LEN),
    )  # fmt: skip
    return w, requests


def make_setup(listed: int, timed_steps: int) -> sched_engine.Setup:
    """sched_engine's setup of ``workload(listed)``, its requests ours."""
    w, requests = workload(listed, timed_steps)
    setup = sched_engine.Setup(w)  # draws no request: arrivals_per_step is 0
    setup.specs = requests  # type: ignore[assignment]
    setup.outputs = {f"req-{i}": requests.output(i) for i in range(len(requests))}
    return setup


class _MovingQueue:
    """vLLM's queue, counting the blocks that leave the free list and enter it into ``moved``."""

    def __init__(self, queue_class: type, moved: Counter[str], blocks: list[Any]) -> None:
        self._q = queue_class(blocks)
        self._moved = moved

    @property
    def num_free_blocks(self) -> int:
        return int(self._q.num_free_blocks)

    def popleft(self) -> Any:
        self._moved["out"] += 1
        return self._q.popleft()

    def popleft_n(self, n: int) -> Any:
        self._moved["out"] += n
        return self._q.popleft_n(n)

    def remove(self, block: Any) -> None:
        self._moved["out"] += 1
        self._q.remove(block)

    def append(self, block: Any) -> None:
        self._moved["in"] += 1
        self._q.append(block)

    def append_n(self, blocks: Iterable[Any]) -> None:
        blocks = list(blocks)
        self._moved["in"] += len(blocks)
        self._q.append_n(blocks)

    def prepend_n(self, blocks: Iterable[Any]) -> None:
        blocks = list(blocks)
        self._moved["in"] += len(blocks)
        self._q.prepend_n(blocks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._q, name)


def listed_blocks(driver: sched_engine.Driver) -> int:
    """The blocks live requests list now, over every manager."""
    managers = driver.scheduler.kv_cache_manager.coordinator.single_type_managers
    return sum(len(blocks) for m in managers for blocks in m.req_to_blocks.values())


def record(setup: sched_engine.Setup) -> dict[str, Any]:
    """One run on vLLM alone, the blocks it moves through the free list after the warm-up
    counted: the schedule and the pool every timed run must reproduce."""
    from vllm.v1.core import block_pool

    original = use(REFERENCE)
    moved: Counter[str] = Counter()

    def counting(blocks: list[Any]) -> _MovingQueue:
        return _MovingQueue(original, moved, blocks)

    with patch.object(block_pool, "FreeKVCacheBlockQueue", counting):
        driver = sched_engine.Driver(setup)
        driver.run(moved.clear)
    timed = setup.workload.steps - setup.workload.warmup_steps
    if driver.counters["preempted"]:
        raise SystemExit(f"{setup.workload.name}: vLLM preempted requests: the pool is too small")
    return {"fingerprint": driver.fingerprint, "pool": pool_state(driver),
            "listed": listed_blocks(driver), "requests": len(driver.scheduler.running),
            "moved_per_step": (moved["in"] + moved["out"]) / timed,
            "counters": driver.counters}  # fmt: skip


class AuditClock:
    """``read_holders`` timed call by call (thread CPU time, as the step's), each call less
    the timer's own time: its reading is a system call, whose time a timed call includes once,
    read back to back beside each call."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def wrap(self, original: Any) -> Any:
        clock, calls = time.thread_time_ns, self.calls

        def timed(*args: Any) -> None:
            before = clock()
            start = clock()
            try:
                original(*args)
            finally:
                calls.append(clock() - start - (start - before))

        return timed


def timed_run(name: str, setup: sched_engine.Setup, recorded: dict[str, Any]) -> dict[str, Any]:
    """One run on contender ``name``: each timed step's seconds and each audit's ns. Fails
    unless it schedules what vLLM alone did and leaves the same pool."""
    audits = AuditClock()
    steps: list[float] = []
    # The step guard takes read_holders when install() makes it: wrapped before.
    with patch.object(_audit, "read_holders", audits.wrap(_audit.read_holders)):
        use(name)
        every = kvqueue.vllm.status()["audit_every"]
        driver = sched_engine.Driver(setup)
        driver.run(audits.calls.clear, steps)
        kvqueue.vllm.uninstall()
    where = f"{setup.workload.name}, {name}"
    if driver.fingerprint != recorded["fingerprint"]:
        raise SystemExit(f"{where}: the schedule differs from vLLM's alone")
    if pool_state(driver) != recorded["pool"]:
        raise SystemExit(f"{where}: the pool after the run differs from vLLM's alone")
    return {"steps": steps, "audits": list(audits.calls), "audit_every": every}


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """One fresh process, one size: the recorded run, then ``reps`` rounds of every contender
    in a new random order."""
    cpu = launch.pin()
    first = job.get("env", {}).get(launch.FIRST)
    if first and not kvqueue.__file__.startswith(os.path.join(first, "")):
        raise SystemExit(f"{job['label']}: kvqueue imported from {kvqueue.__file__}, not {first}")
    rng = random.Random(job["seed"])
    setup = make_setup(job["listed_target"], job["timed_steps"])
    recorded = record(setup)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTENDERS}
    contenders = list(CONTENDERS)
    for _ in range(job["reps"]):
        rng.shuffle(contenders)
        for name in contenders:
            runs[name].append(timed_run(name, setup, recorded))
    del recorded["pool"], recorded["fingerprint"]
    return {**job, "cpu": cpu, "pid": os.getpid(), **recorded, "runs": runs,
            "kvqueue": kvqueue.__file__}  # fmt: skip


def per_process(record: dict[str, Any], name: str) -> dict[str, float]:
    """Contender ``name``'s figures in one process, against vLLM alone's there."""
    runs, ref = record["runs"][name], record["runs"][REFERENCE]
    steps = len(ref[0]["steps"])

    def step_median(rs: list[dict[str, Any]]) -> float:
        return float(median(median(r["steps"]) for r in rs))

    def total(rs: list[dict[str, Any]]) -> float:
        return float(median(sum(r["steps"]) for r in rs))

    def by_step(rs: list[dict[str, Any]]) -> list[float]:
        return [median(r["steps"][i] for r in rs) for i in range(steps)]

    added = [a - b for a, b in zip(by_step(runs), by_step(ref), strict=True)]
    audits = [median(r["audits"]) for r in runs] if runs[0]["audits"] else [0.0]
    return {
        "step_ms": step_median(runs) * 1e3,
        "ratio": step_median(runs) / step_median(ref),
        "added_us": (total(runs) - total(ref)) / steps * 1e6,
        "max_added_ms": max(added) * 1e3,
        "audit_us": median(sum(r["audits"]) for r in runs) / steps / 1e3,
        "audit_median_us": median(audits) / 1e3,
        "audit_max_ms": max((max(r["audits"], default=0) for r in runs), default=0) / 1e6,
    }


def rows(records: list[dict[str, Any]]) -> list[str]:
    """The table's rows: per size, vLLM alone, then each twin against it."""
    out = []
    shown = None
    for listed, build in sorted(dict.fromkeys((r["listed_target"], r["build"]) for r in records)):
        per = [r for r in records if (r["listed_target"], r["build"]) == (listed, build)]
        first = per[0]
        ref = median(per_process(r, REFERENCE)["step_ms"] for r in per)
        size = f"{listed:,} | {first['listed']:,} | {first['requests']:,} "
        size += f"| {first['moved_per_step']:,.0f}"
        if shown == listed:  # the size's figures once, on its first build's row
            size = "| | |"
        shown = listed
        out.append(f"| {size} | {build} | vllm | {ref:.2f} | 1 | | | | | |")
        for name in CONTENDERS[1:]:
            f = [per_process(r, name) for r in per]

            def mid(key: str, fs: list[dict[str, float]] = f) -> float:
                return median(x[key] for x in fs)

            ratio = bootstrap_median([x["ratio"] for x in f])
            per_block = mid("added_us") / first["moved_per_step"] * 1e3
            out.append(
                f"| | | | | | {name} | {mid('step_ms'):.2f} | {interval(ratio)} "
                f"| {mid('added_us'):,.0f} | {per_block:,.0f} | {mid('max_added_ms'):.2f} "
                f"| {mid('audit_us'):,.1f} ({mid('audit_median_us'):,.1f}) "
                f"| {mid('audit_max_ms'):.2f} |"
            )
    return out


def table(data: dict[str, Any]) -> str:
    s = data["settings"]
    lines = [
        f"vLLM {data['vllm']}'s `Scheduler` on the CPU (fake model) by listed blocks, 2% of "
        f"requests replaced a step; median of {s['processes']} fresh processes, side by side "
        "[bootstrap 95% interval]. Step: thread CPU time of `schedule()` + "
        "`update_from_output()`; runs per contender per process x timed steps, per size: "
        + ", ".join(f"{k:,}: {s['reps'][k]} x {v}" for k, v in s["timed_steps"].items())
        + f" (after {WARMUP_STEPS}); `KVQUEUE_AUDIT_EVERY`: {s['audit_every']} (0: no full "
        "reads).",
        "",
        "*added*: the contender's time over vLLM alone's, per step, its full reads included; "
        "*per moved block*: that over the blocks leaving and entering the free list per step; "
        "*max added*: the largest one step's; *audit*: the audit's reads' own time "
        "(`read_holders`, less the timer's, read beside each call; a step with nothing to read "
        "is passed without one), mean per step (median read), and its longest read.",
        "",
        "| listed (target) | listed | requests | moved blocks/step | kvqueue | contender "
        "| ms/step | vs vllm | added µs/step | added ns/moved block | max added ms "
        "| audit µs/step | audit max ms |",
        "|---:|---:|---:|---:|---|---|---:|---|---:|---:|---:|---:|---:|",
        *rows(data["records"]),
        "",
        f"Machine: {launch.short(data['machine'])}; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in data['loadavg'])}.",
    ]
    return "\n".join(lines)


def _this_build() -> str:
    """This checkout's commit (with ``+`` if it has changes), or "this build" outside git."""
    here = str(Path(__file__).resolve().parent)

    def git(*args: str) -> str:
        done = subprocess.run(("git", "-C", here, *args), capture_output=True, check=True)
        return done.stdout.decode().strip()

    try:
        commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "../src")
    except (OSError, subprocess.CalledProcessError):
        return "this build"
    return commit + ("+" if dirty else "")


def results_path(out: Path) -> Path:
    """Where ``--out FILE`` puts the results: beside FILE, ``-scale`` added to its name, so
    that make bench-audit's one ``--out`` keeps audit.py's file too."""
    return out.with_name(f"{out.stem}-scale{out.suffix}")


def main() -> None:
    parser = launch.parser(__doc__, "2 processes x 2 runs, fewer steps, up to 100,000 blocks")
    parser.add_argument("--processes", type=int, help="fresh processes per size (3; quick 2)")
    parser.add_argument("--reps", type=int, help="runs per contender per process (3; quick 2)")
    parser.add_argument("--sizes", type=int, nargs="+", choices=SIZES, help="listed blocks")
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="also run, in processes alternating with this build's, the kvqueue importable "
        "from DIR (pip install --target DIR <checkout>), named by DIR's name",
    )
    # make bench-audit hands audit.py's arguments to this script too.
    parser.add_argument("--cpu-time", action="store_true", help="accepted: steps are CPU time")
    args = parser.parse_args()
    processes, reps = ROUNDS[args.quick]
    processes, reps = args.processes or processes, args.reps or reps
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    timed = {size: TIMED_STEPS[size][args.quick] for size in sizes}
    rng = random.Random(0)
    builds: list[tuple[str, dict[str, str]]] = [(_this_build(), {})]
    if args.baseline:
        first = str(args.baseline.resolve())
        builds.append((args.baseline.name, {launch.FIRST: first}))
    # Each round's processes of one size run one seed on every build, back to back.
    jobs = [{"label": f"{size:,} listed, {build}, round {i + 1}", "listed_target": size,
             "timed_steps": timed[size], "seed": seed, "build": build, "env": env,
             "reps": min(reps, MOST_REPS.get(size, reps))}
            for i in range(processes) for size in sizes
            for seed in [rng.randrange(2**32)] for build, env in builds]  # fmt: skip
    records = launch.run(worker, jobs)
    every = {r["runs"]["cython+guard"][0]["audit_every"] for r in records}
    reps_of = {job["listed_target"]: job["reps"] for job in jobs}
    settings = {"processes": processes, "reps": reps_of, "quick": args.quick,
                "timed_steps": timed, "audit_every": sorted(every)}  # fmt: skip
    data = {"machine": launch.describe(), "vllm": metadata.version("vllm"), "settings": settings,
            "loadavg": os.getloadavg(), "records": records}  # fmt: skip
    out = launch.save(data, args.out and results_path(args.out), "scale")
    print(table(data))
    print(f"\n(raw results: {out})", file=sys.stderr)


if __name__ == "__main__":
    main()
