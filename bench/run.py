"""Benchmark kvqueue's twins against vLLM's own FreeKVCacheBlockQueue and collections.deque.

Usage and method: bench/README.md. Each case runs in fresh processes; the Markdown tables go to
stdout, the raw samples to a JSON file and the ratio chart to a PNG beside it. A results file
holds ``machine``, ``settings`` (with the ``reference`` contender) and ``records``, one per
process, each with every raw sample in ns per cycle. It times whatever ``kvqueue`` imports.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from statistics import median
from time import perf_counter_ns, thread_time_ns
from typing import Any

import cases
import contenders
import launch
from contenders import PINNED, REFERENCE
from launch import Estimate, bootstrap_median, interval, short

# Processes per case, samples per process, the reference's time per sample (ms).
FULL, QUICK = (11, 9, 20.0), (3, 5, 2.0)
# --lines: every vLLM line's queue and both twins in the same processes (FULL's), on these
# cases only: the one-block cycles, a batch, a cache hit where code, not cache misses, bounds it.
LINE_CASES = (
    "popleft + append @100000",
    "popleft_n(1) + append_n @100000",
    "popleft_n(8) + append_n @100000",
    "remove + append @2048",
)
# What they call: the lines whose queues define these alike share a label in the table.
LINE_METHODS = ("popleft", "append", "popleft_n", "append_n", "remove")


# -- one fresh process: one case, every contender

# --cpu-time: the thread's CPU time leaves out the time this process waited for its CPU while a
# neighbour's job ran on it (a shared host's largest noise); what they do to the caches stays in.
CLOCKS = {"wall": perf_counter_ns, "cpu": thread_time_ns}


def timed(bench: cases.Bench, loops: int, clock: Callable[[], int]) -> int:
    """One sample: ``loops`` cycles, in ns. timeit pauses the collector: a collection landing in
    one sample would be charged to one contender."""
    bench.prepare()
    return int(timeit.Timer(lambda: bench.run(loops), timer=clock).timeit(1))


def calibrate(bench: cases.Bench, target_ns: int, clock: Callable[[], int]) -> tuple[int, int]:
    """Loops for one sample of about ``target_ns`` on ``bench``; also the cycles spent."""
    loops, spent = 1, 0
    while True:
        elapsed = timed(bench, loops, clock)
        spent += loops
        if elapsed >= target_ns:
            return loops, spent
        loops *= 2 if elapsed < target_ns / 4 else 1 + int(target_ns / max(elapsed, 1))


def measure(job: dict[str, Any]) -> dict[str, Any]:
    cpu = launch.pin()
    case = next(c for c in cases.all_cases() if c.key == job["case"])
    rng = random.Random(job["seed"])
    names = list(job["contenders"])
    rng.shuffle(names)
    benches = {}
    for name in names:
        # The same seed for all: every contender walks the same shuffled orders.
        bench = case.build(contenders.load(name), case.pool, random.Random(job["seed"]))
        if bench is not None:
            benches[name] = bench
    gc.collect()
    gc.freeze()  # the pools are permanent: no later collection walks them

    reference, clock = job["reference"], CLOCKS[job["clock"]]
    if case.single_shot:
        loops, spent = 1, 0
    else:
        loops, spent = calibrate(benches[reference], job["target_ns"], clock)
    for name, bench in benches.items():
        if name != reference and spent:
            bench.run(spent)
        timed(bench, loops, clock)
    expected = benches[reference].ids()
    wrong = [name for name, bench in benches.items() if bench.ids() != expected]
    if wrong:
        raise SystemExit(f"{case.key}: {wrong} disagree with {reference}: a wrong queue")

    samples: dict[str, list[float]] = {name: [] for name in benches}
    shuffles = []
    for _ in range(job["samples"]):
        order = list(benches)
        rng.shuffle(order)
        shuffles.append(order)
        for name in order:
            samples[name].append(timed(benches[name], loops, clock) / loops)
    return {
        "case": case.key, "name": case.name, "pool": case.pool, "cycle": case.cycle,
        "round": job["round"], "seed": job["seed"], "cpu": cpu, "pid": os.getpid(),
        "loops": loops, "orders": shuffles, "samples_ns": samples,
    }  # fmt: skip


# -- the parent


def bench(
    quick: bool, baseline: str | None, lines: bool, clock: str, only: list[str] | None = None
) -> dict[str, Any]:
    processes, samples, sample_ms = QUICK if quick else FULL
    wanted = contenders.EVERY_LINE if lines else contenders.QUICK if quick else contenders.ALL
    if baseline:
        try:
            baseline = contenders.resolve(baseline)
        except LookupError as exc:
            raise SystemExit(f"--baseline: {exc}") from exc
        # Each twin's old build just before it: the table reads old, new.
        twin_runs = {twin: (f"{twin}@{baseline}", twin) for twin in contenders.TWINS}
        wanted = tuple(run for name in wanted for run in twin_runs.get(name, (name,)))
    names, skipped = [], {}
    for name in wanted:
        try:
            contenders.load(name)
        except LookupError as exc:
            skipped[name] = str(exc)
            print(f"skipping {name}: {exc}", file=sys.stderr)
            continue
        names.append(name)
    fallback = contenders.FALLBACK_REFERENCE
    reference = REFERENCE if REFERENCE in names else fallback
    if reference not in names:
        raise SystemExit(f"no reference: neither {REFERENCE} nor {fallback} loads")
    if lines:
        every = {case.key: case for case in cases.all_cases()}
        selected = [every[key] for key in LINE_CASES]
    else:
        selected = cases.all_cases(quick)
    if only:
        selected = [case for case in selected if any(part in case.key for part in only)]
        if not selected:
            raise SystemExit(f"--case {' '.join(only)}: no case's key holds it")
    rng = random.Random(0)
    jobs = []
    for round_ in range(processes):
        jobs += [
            {"case": case.key, "label": f"round {round_ + 1} {case.key}",
             "round": round_, "seed": rng.randrange(2**32),
             "contenders": names, "reference": reference, "samples": samples, "clock": clock,
             "target_ns": int(sample_ms * 1e6)}
            for case in rng.sample(selected, len(selected))
        ]  # fmt: skip
    # Described first: the checkout may move on during a long run.
    described = launch.describe()
    started = time.time()
    records = launch.run(measure, jobs)
    settings = {
        "reference": reference, "contenders": names, "skipped": skipped,
        "releases": {n: v for n, v in contenders.VLLM_VERSIONS.items() if n in names},
        "same_code": contenders.same_code(names, LINE_METHODS) if lines else {},
        "cases": [case.key for case in selected],
        "processes": processes, "samples": samples, "sample_ms": sample_ms,
        "quick": quick, "baseline": baseline, "lines": lines, "clock": clock,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
    }  # fmt: skip
    return {"machine": described, "settings": settings, "records": records}


# -- the summary: ratios per process, their medians and intervals, the tables, the chart

# The seed's targets, on the large pool: (contender, case, against, at most).
SINGLETON = "popleft_n(1) + append_n @100000"
TARGETS = (
    ("pure", SINGLETON, REFERENCE, 0.83),
    ("cython", SINGLETON, REFERENCE, 0.20),
    ("cython", "popleft_n(32) + append_n @100000", REFERENCE, 0.35),
    ("cython", "remove + append @100000", REFERENCE, 0.50),
    ("cython", "mix @100000", REFERENCE, 0.25),
    ("cython", "popleft + append @100000", "deque", 2.5),
)
# ... and the pure twin within 10% of the pinned vLLM in every case on the large pool.
PURE_VS_PINNED = 1.10


def ratio(records: list[dict[str, Any]], contender: str, against: str) -> Estimate | None:
    """Median over processes of (contender's median / against's median) in that process."""
    per_process = [
        median(r["samples_ns"][contender]) / median(r["samples_ns"][against])
        for r in records
        if contender in r["samples_ns"] and against in r["samples_ns"]
    ]
    return bootstrap_median(per_process) if per_process else None


def by_case(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The records of each case, in the order of the cases."""
    records = results["records"]
    return {key: [r for r in records if r["case"] == key] for key in results["settings"]["cases"]}


def fmt_ns(ns: float) -> str:
    if ns < 1e3:
        return f"{ns:.0f} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.3g} µs"
    return f"{ns / 1e6:.3g} ms"


def _clock(settings: dict[str, Any]) -> str:
    """How the samples were timed, for a caption."""
    if settings["clock"] == "cpu":
        return "Timed by the thread's CPU time (`--cpu-time`)."
    return "Timed by the wall clock."


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _cell(records: list[dict[str, Any]], name: str, reference: str) -> str:
    """``ratio to the reference · median time per cycle``, or n/a where the case has no such
    cycle (the deque's ``remove``)."""
    if name not in records[0]["samples_ns"]:
        return "n/a"
    ns = median(median(r["samples_ns"][name]) for r in records)
    shown = "1" if name == reference else interval(ratio(records, name, reference))
    return f"{shown} · {fmt_ns(ns)}"


def table(results: dict[str, Any]) -> str:
    settings = results["settings"]
    reference = settings["reference"]
    names = settings["contenders"]
    lines = [
        f"Ratio of time to `{reference}` (median of {settings['processes']} processes x "
        f"{settings['samples']} samples, [bootstrap 95% interval]) · median time per cycle. "
        "Every contender held the same order as the reference after the same warm-up. "
        + _clock(settings),
        f"{short(results['machine'])}.",
        "",
        _row(["case", "pool", "one cycle", *(f"`{n}`" for n in names)]),
        "|---|---:|---|" + "---:|" * len(names),
    ]
    for records in by_case(results).values():
        first = records[0]
        cells = [_cell(records, name, reference) for name in names]
        lines.append(_row([first["name"], f"{first['pool']:,}", first["cycle"], *cells]))
    return "\n".join(lines)


def targets(results: dict[str, Any]) -> str:
    """The issue's targets: ✓ whole interval within, ~ median only, ✗ missed."""
    grouped = by_case(results)
    lines = ["| target | measured [95% interval] | |", "|---|---|---|"]
    for contender, key, against, limit in TARGETS:
        estimate = ratio(grouped.get(key, []), contender, against)
        label = f"`{contender}` {key} vs `{against}` <= {limit}"
        lines.append(_target_line(label, estimate, limit))
    large = {
        key: estimate
        for key, records in grouped.items()
        if records[0]["pool"] == 100_000 and (estimate := ratio(records, "pure", PINNED))
    }
    if large:
        worst = max(large, key=lambda key: large[key].median)
        label = f"`pure` vs `{PINNED}` <= {PURE_VS_PINNED} in every case (worst: {worst})"
        lines.append(_target_line(label, large[worst], PURE_VS_PINNED))
    return "\n".join(lines)


def _target_line(label: str, estimate: Estimate | None, limit: float) -> str:
    if estimate is None:
        return f"| {label} | not measured | |"
    mark = "✓" if estimate.high <= limit else "~" if estimate.median <= limit else "✗"
    return f"| {label} | {interval(estimate)} | {mark} |"


def versus(results: dict[str, Any]) -> str:
    """Each twin against its own build at the baseline revision, in the same processes."""
    settings = results["settings"]
    names = settings["contenders"]
    pairs = [(twin, f"{twin}@{settings['baseline']}") for twin in contenders.TWINS]
    pairs = [(new, old) for new, old in pairs if new in names and old in names]
    lines = [
        f"Ratio of time of each twin today to the same twin at `{settings['baseline']}` "
        f"(median of {settings['processes']} processes x {settings['samples']} samples, "
        "[bootstrap 95% interval]); below 1 is faster today.",
        "",
        _row(["case", "pool", *(f"`{new}` / `{old}`" for new, old in pairs)]),
        "|---|---:|" + "---:|" * len(pairs),
    ]
    for records in by_case(results).values():
        first = records[0]
        cells = [interval(ratio(records, new, old)) for new, old in pairs]
        lines.append(_row([first["name"], f"{first['pool']:,}", *cells]))
    return "\n".join(lines)


def lines_table(results: dict[str, Any]) -> str:
    """One row per vLLM line: per case, the line against the reference, then each twin
    against the line, all in the same processes."""
    settings = results["settings"]
    reference, same = settings["reference"], settings["same_code"]
    grouped = by_case(results)
    twins = [twin for twin in contenders.TWINS if twin in settings["contenders"]]
    header = ["line", "release", "same code as"]
    for records in grouped.values():
        case = f"{records[0]['name']} @{records[0]['pool']:,}"
        header += [f"{case}: line", *(f"`{twin}` / line" for twin in twins)]
    out = [
        f"Each vLLM line's queue and kvqueue's twins, in the same {settings['processes']} "
        f"processes per case x {settings['samples']} samples (about {settings['sample_ms']:g} ms "
        f"of `{reference}` a sample). Per case: the line's ratio of time to `{reference}` "
        "[bootstrap 95% interval] · its median time per cycle, then each twin's ratio to the "
        f"line. *Same code as*: the first line whose {', '.join(LINE_METHODS)} are the same "
        "code (syntax tree). " + _clock(settings),
        f"{short(results['machine'])}.",
        "",
        _row(header),
        "|---|---|---|" + "---:|" * (len(header) - 3),
    ]
    for name, release in settings["releases"].items():
        cells = [f"`{name}`", release, same[name]]
        for records in grouped.values():
            cells.append(_cell(records, name, reference))
            cells += [interval(ratio(records, twin, name)) for twin in twins]
        out.append(_row(cells))
    skipped = settings["skipped"]
    if skipped:
        out.append("\nNot measured: " + "; ".join(f"`{n}` ({why})" for n, why in skipped.items()))
    return "\n".join(out)


# The chart: pinned vLLM, the twins (their baseline builds hollow), the deque.
MARKERS = {PINNED: "s", "pure": "o", "cython": "D", "deque": "^"}
TICKS = (0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 3)


def chart(results: dict[str, Any], path: Path) -> None:
    """One line per case, one marker per contender at its ratio, with its 95% interval.
    ImportError without matplotlib (the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    reference = results["settings"]["reference"]
    rows = list(by_case(results).values())
    names = [n for n in results["settings"]["contenders"] if n != reference]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.8))
    height = 0.7 / max(len(names), 1)
    twins = list(dict.fromkeys(name.partition("@")[0] for name in names))
    for i, name in enumerate(names):
        shown = [(y, e) for y, records in enumerate(rows) if (e := ratio(records, name, reference))]
        twin, at, _ = name.partition("@")
        ax.errorbar(
            [e.median for _, e in shown],
            [y - 0.35 + height * (i + 0.5) for y, _ in shown],
            xerr=[[e.median - e.low for _, e in shown], [e.high - e.median for _, e in shown]],
            fmt=MARKERS.get(twin, "o"),
            color=f"C{twins.index(twin)}",
            mfc="none" if at else None,
            capsize=2,
            label=name,
            ms=4,
        )
    ax.axvline(1.0, color="grey", lw=1, ls="--", label=f"{reference} (reference, = 1)")
    ax.set_xscale("log")
    ticks = [t for t in TICKS if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    # A log axis labels its minor ticks too when the range is short, over the ticks above.
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yticks(range(len(rows)), [f"{r[0]['name']} @{r[0]['pool']:,}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ratio to {reference} (log scale; lower is faster), 95% interval")
    ax.grid(axis="x", which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    title = f"Time of one cycle of each queue operation, as a ratio to {reference}, per case"
    fig.suptitle(title, fontweight="bold")
    ax.set_title(short(results["machine"]).replace("; ", "\n"), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def publish(results: dict[str, Any], path: Path) -> None:
    settings = results["settings"]
    if settings["lines"]:
        print(lines_table(results))
        print(f"\nraw samples: {path}", file=sys.stderr)
        return
    print(table(results))
    if settings["reference"] == REFERENCE:
        print("\n" + targets(results))
    if settings["baseline"]:
        print("\n" + versus(results))
    print(f"\nraw samples: {path}", file=sys.stderr)
    try:
        chart(results, path.with_suffix(".png"))
        print(f"chart: {path.with_suffix('.png')}", file=sys.stderr)
    except ImportError:
        print("chart skipped: no matplotlib (pip install 'kvqueue[bench]')", file=sys.stderr)


def main() -> None:
    parser = launch.parser(__doc__, "smoke test: small, no vLLM")
    parser.add_argument("--baseline", metavar="REV", help="also time the twins at git REV")
    parser.add_argument(
        "--lines", action="store_true", help="every vLLM line's queue vs the twins: one table"
    )
    parser.add_argument(
        "--cpu-time", action="store_true", help="time by the thread's CPU time, not the wall clock"
    )
    parser.add_argument(
        "--case",
        action="append",
        metavar="TEXT",
        help="only the cases whose key (e.g. 'popleft + append @2048') holds TEXT; repeatable",
    )
    args = parser.parse_args()
    if args.lines and (args.quick or args.baseline):
        parser.error("--lines takes neither --quick nor --baseline")
    clock = "cpu" if args.cpu_time else "wall"
    results = bench(args.quick, args.baseline, args.lines, clock, args.case)
    kind = "lines" if args.lines else "quick" if args.quick else "full"
    publish(results, launch.save(results, args.out, kind))


if __name__ == "__main__":
    main()
