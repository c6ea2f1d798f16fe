"""Medians and bootstrap intervals over the per-process results."""

from __future__ import annotations

import random
from collections.abc import Sequence
from statistics import median

RESAMPLES = 5_000


def bootstrap_median(values: Sequence[float], seed: int = 0) -> tuple[float, float, float]:
    """The median of ``values`` and a percentile-bootstrap 95% interval for it.

    The values are per-process results: the process, not the sample, is the unit that
    repeats (a process draws its own memory layout, CPU and neighbours' load).
    """
    if not values:
        raise ValueError("no values")
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(median(rng.choices(values, k=n)) for _ in range(RESAMPLES))
    return median(values), medians[int(0.025 * RESAMPLES)], medians[int(0.975 * RESAMPLES) - 1]
