"""The checks vLLM makes with ``assert`` still happen under ``python -O``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from invalid_ops import CASES, outcome

SUPPORT = Path(__file__).parent / "support"
RUN_CASES = """
import importlib, json, sys
from invalid_ops import CASES, outcome
from kvqueue import KVCacheBlock
mod = importlib.import_module(sys.argv[1])
results = {name: outcome(mod, name) for name in CASES}
block = KVCacheBlock(0)
block.set_block_hash(b"h")
try:
    block.set_block_hash(b"i")
    results["set_block_hash_twice"] = "no exception"
except AssertionError as exc:
    results["set_block_hash_twice"] = str(exc)
print(json.dumps(results))
"""


def _run(module: str, *flags: str) -> dict[str, object]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, *flags, "-c", RUN_CASES, module],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    results: dict[str, object] = json.loads(done.stdout)
    return results


def test_invalid_operations_under_dash_o(queue_mod: ModuleType) -> None:
    optimized = _run(queue_mod.__name__, "-O")
    assert optimized.pop("set_block_hash_twice") == (
        "The block already has a hash. This should not happen."
    )
    expected = {name: list(outcome(queue_mod, name)) for name in CASES}
    assert optimized == expected
    assert all(untouched for _, _, untouched in expected.values())


def test_dash_o_really_strips_asserts() -> None:
    done = subprocess.run([sys.executable, "-O", "-c", "assert False"], check=False)
    assert done.returncode == 0
