"""The fuzz programs, each seed in its own process: a crash or a hang fails one test.

Fast by default: 3 seeds of a few thousand operations per program and twin.
The long mode, ``KVQUEUE_CI_FUZZ_LONG=1``, runs 25 seeds of 7 times as many;
``KVQUEUE_CI_FUZZ_SEED`` moves the seeds (a failure names its seed).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from support.helpers import run_isolated

LONG = os.environ.get("KVQUEUE_CI_FUZZ_LONG", "") not in ("", "0")
FIRST_SEED = int(os.environ.get("KVQUEUE_CI_FUZZ_SEED", "0"))
SEEDS = range(FIRST_SEED, FIRST_SEED + (25 if LONG else 3))
# Operations per program run; the timeout is far above any normal run.
OPS = {
    "fuzz_diff": 3000,
    "fuzz_reentrant": 2000,
    "fuzz_chaos": 2000,
    "fuzz_threads": 5000,
    "fuzz_race": 5000,
    "fuzz_guard": 2000,
}
TIMEOUT = 1800 if LONG else 120

CASES = [
    # fuzz_diff runs both twins against each other, so it needs the compiled one.
    pytest.param("fuzz_diff", "cython", id="diff", marks=pytest.mark.cython),
    pytest.param("fuzz_reentrant", "cython", id="reentrant-cython", marks=pytest.mark.cython),
    pytest.param("fuzz_reentrant", "python", id="reentrant-python"),
    pytest.param("fuzz_chaos", "cython", id="chaos-cython", marks=pytest.mark.cython),
    pytest.param("fuzz_chaos", "python", id="chaos-python"),
    pytest.param("fuzz_threads", "cython", id="threads-cython", marks=pytest.mark.cython),
    pytest.param("fuzz_threads", "python", id="threads-python"),
    pytest.param("fuzz_race", "cython", id="race-cython", marks=pytest.mark.cython),
    pytest.param("fuzz_guard", "cython", id="guard-cython", marks=pytest.mark.cython),
    pytest.param("fuzz_guard", "python", id="guard-python"),
]


def run_program(program: str, twin: str, seed: int, ops: int) -> dict[str, int]:
    """Run one fuzz program in a fresh interpreter; its counters."""
    try:
        done = run_isolated(program, twin, str(seed), str(ops), timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{program} {twin} seed {seed} hung (> {TIMEOUT} s)")
    assert done.returncode == 0, (
        f"{program} {twin} seed {seed} exited with {done.returncode}:\n{done.stderr[-4000:]}"
    )
    assert done.stderr == "", done.stderr[-4000:]
    stats: dict[str, int] = json.loads(done.stdout.splitlines()[-1])
    return stats


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("program", "twin"), CASES)
def test_fuzz_program(program: str, twin: str, seed: int) -> None:
    ops = OPS[program] * (7 if LONG else 1)
    stats = run_program(program, twin, seed, ops)
    assert stats["ops"] == ops
    if program == "fuzz_chaos":  # the repair paths ran, and their log
        assert stats["repairs_logged"] > 0
    if program == "fuzz_guard":  # the guard repaired, refused, and met its adversaries
        assert min(stats["repairs"], stats["refused"], stats["finalizers"]) > 0


@pytest.mark.cython
@pytest.mark.parametrize("run", range(3))
def test_guard_switch_under_load_does_not_crash(run: int) -> None:
    """A guard replaced while another thread calls it was freed inside the
    assignment, before the class's caches dropped it (9 of 10 runs of 20,000 switches died
    of SIGSEGV before the fix)."""
    done = run_isolated("guard_switch", "20000", timeout=TIMEOUT)
    assert done.returncode == 0, f"exited with {done.returncode}:\n{done.stderr[-4000:]}"
    assert done.stderr == "", done.stderr[-4000:]
    assert json.loads(done.stdout.splitlines()[-1])["switches"] == 20000
