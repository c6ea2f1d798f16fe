"""From raw samples to the summary: per-process ratios, their medians and intervals, tables.

A results file holds ``machine``, ``settings`` (with the ``reference`` contender) and
``records``, one per worker process, each with every raw sample in ns per cycle.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import median
from typing import Any

from contenders import PINNED, REFERENCE
from launch import Estimate, bootstrap_median, interval, short

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


@dataclass(frozen=True)
class Row:
    key: str
    name: str
    pool: int
    cycle: str
    ratios: dict[str, Estimate]  # against the reference
    ns: dict[str, float]  # median ns per cycle


def ratio(records: list[dict[str, Any]], contender: str, against: str) -> Estimate | None:
    """Median over processes of (contender's median / against's median) in that process."""
    per_process = [
        median(r["samples_ns"][contender]) / median(r["samples_ns"][against])
        for r in records
        if contender in r["samples_ns"] and against in r["samples_ns"]
    ]
    if not per_process:
        return None
    return bootstrap_median(per_process)


def by_case(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in results["records"]:
        grouped[record["case"]].append(record)
    return grouped


def summarize(results: dict[str, Any]) -> list[Row]:
    reference = results["settings"]["reference"]
    rows = []
    for key, records in by_case(results).items():
        names = [n for n in results["settings"]["contenders"] if n in records[0]["samples_ns"]]
        ratios = {n: e for n in names if (e := ratio(records, n, reference)) is not None}
        ns = {n: median(median(r["samples_ns"][n]) for r in records if n in r["samples_ns"])
              for n in names}  # fmt: skip
        first = records[0]
        rows.append(Row(key, first["name"], first["pool"], first["cycle"], ratios, ns))
    order = list(results["settings"]["cases"])
    rows.sort(key=lambda row: order.index(row.key))
    return rows


def fmt_ns(ns: float) -> str:
    if ns < 1e3:
        return f"{ns:.0f} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.3g} µs"
    return f"{ns / 1e6:.3g} ms"


def _cell(row: Row, name: str, reference: str) -> str:
    if name not in row.ns:
        return "n/a"
    if name == reference:
        return f"1 · {fmt_ns(row.ns[name])}"
    return f"{interval(row.ratios[name])} · {fmt_ns(row.ns[name])}"


def table(results: dict[str, Any]) -> str:
    settings = results["settings"]
    reference = settings["reference"]
    names = settings["contenders"]
    lines = [
        f"Ratio of time to `{reference}` (median of {settings['processes']} processes x "
        f"{settings['samples']} samples, [bootstrap 95% interval]) · median time per cycle. "
        "Every contender held the same order as the reference after the same warm-up.",
        f"{short(results['machine'])}.",
        "",
        "| case | pool | one cycle | " + " | ".join(f"`{n}`" for n in names) + " |",
        "|---|---:|---|" + "---:|" * len(names),
    ]
    for row in summarize(results):
        cells = [_cell(row, name, reference) for name in names]
        lines.append(f"| {row.name} | {row.pool:,} | {row.cycle} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(results: dict[str, Any]) -> str:
    """The issue's targets: ✓ whole interval within, ~ median only, ✗ missed."""
    grouped = by_case(results)
    lines = ["| target | measured [95% interval] | |", "|---|---|---|"]
    for contender, key, against, limit in TARGETS:
        estimate = ratio(grouped.get(key, []), contender, against)
        label = f"`{contender}` {key} vs `{against}` <= {limit}"
        lines.append(_target_line(label, estimate, limit))
    worst: tuple[str, Estimate] | None = None
    for key, records in grouped.items():
        if records[0]["pool"] != 100_000:
            continue
        estimate = ratio(records, "pure", PINNED)
        if estimate is not None and (worst is None or estimate.median > worst[1].median):
            worst = (key, estimate)
    if worst is not None:
        label = f"`pure` vs `{PINNED}` <= {PURE_VS_PINNED} in every case (worst: {worst[0]})"
        lines.append(_target_line(label, worst[1], PURE_VS_PINNED))
    return "\n".join(lines)


def _target_line(label: str, estimate: Estimate | None, limit: float) -> str:
    if estimate is None:
        return f"| {label} | not measured | |"
    mark = "✓" if estimate.high <= limit else "~" if estimate.median <= limit else "✗"
    return f"| {label} | {interval(estimate)} | {mark} |"


def baseline_pairs(results: dict[str, Any]) -> list[tuple[str, str]]:
    """(twin, the same twin at the baseline revision) for each baseline contender timed."""
    names = results["settings"]["contenders"]
    split = (name.partition("@") for name in names)
    return [(twin, f"{twin}@{rev}") for twin, at, rev in split if at and twin in names]


def versus(results: dict[str, Any]) -> str:
    """Each twin against its own build at the baseline revision, in the same processes."""
    settings = results["settings"]
    pairs = baseline_pairs(results)
    grouped = by_case(results)
    lines = [
        f"Ratio of time of each twin today to the same twin at `{settings['baseline']}` "
        f"(median of {settings['processes']} processes x {settings['samples']} samples, "
        "[bootstrap 95% interval]); below 1 is faster today.",
        "",
        "| case | pool | " + " | ".join(f"`{new}` / `{old}`" for new, old in pairs) + " |",
        "|---|---:|" + "---:|" * len(pairs),
    ]
    for key in settings["cases"]:
        first = grouped[key][0]
        estimates = [ratio(grouped[key], new, old) for new, old in pairs]
        cells = [interval(e) if e is not None else "n/a" for e in estimates]
        lines.append(f"| {first['name']} | {first['pool']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
