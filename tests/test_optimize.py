"""The checks vLLM makes with ``assert`` still happen under ``python -O``."""

from __future__ import annotations

import json
import subprocess
import sys
from types import ModuleType

from support.helpers import run_isolated
from support.invalid_ops import CASES, outcome


def _optimized(module: str) -> dict[str, object]:
    done = run_isolated("optimized", module, flags=("-O",))
    assert done.returncode == 0, done.stderr[-4000:]
    results: dict[str, object] = json.loads(done.stdout)
    return results


def test_invalid_operations_under_dash_o(queue_mod: ModuleType) -> None:
    optimized = _optimized(queue_mod.__name__)
    assert optimized.pop("set_block_hash_twice") == (
        "The block already has a hash. This should not happen."
    )
    expected = {name: list(outcome(queue_mod, name)) for name in CASES}
    assert optimized == expected
    assert all(untouched for _, _, untouched in expected.values())


def test_dash_o_really_strips_asserts() -> None:
    done = subprocess.run([sys.executable, "-O", "-c", "assert False"], check=False)
    assert done.returncode == 0
