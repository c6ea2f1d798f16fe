"""The ratio chart (needs matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from contenders import PINNED
from launch import short
from report import summarize

MARKERS = {PINNED: "s", "pure": "o", "cython": "D", "deque": "^"}
TICKS = (0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 3)


def draw(results: dict[str, Any], path: Path) -> None:
    """One line per case, one marker per contender at its ratio, with its 95% interval.
    ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reference = results["settings"]["reference"]
    rows = summarize(results)
    names = [n for n in results["settings"]["contenders"] if n != reference]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.8))
    height = 0.7 / max(len(names), 1)
    # A twin and its build at the baseline revision share a colour and marker (hollow).
    twins = list(dict.fromkeys(name.partition("@")[0] for name in names))
    for i, name in enumerate(names):
        ys, xs, lows, highs = [], [], [], []
        for y, row in enumerate(rows):
            estimate = row.ratios.get(name)
            if estimate is None:
                continue
            ys.append(y - 0.35 + height * (i + 0.5))
            xs.append(estimate.median)
            lows.append(estimate.median - estimate.low)
            highs.append(estimate.high - estimate.median)
        twin, at, _ = name.partition("@")
        ax.errorbar(
            xs,
            ys,
            xerr=[lows, highs],
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
    ax.set_yticks(range(len(rows)), [f"{row.name} @{row.pool:,}" for row in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ratio to {reference} (log scale; lower is faster), 95% interval")
    ax.grid(axis="x", which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.suptitle(
        f"Time of one cycle of each queue operation, as a ratio to {reference}, per case",
        fontweight="bold",
    )
    ax.set_title(short(results["machine"]).replace("; ", "\n"), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
