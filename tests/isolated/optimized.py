"""What the invalid operations of ``support.invalid_ops`` do on a twin, and what setting a
block's hash twice raises, as one JSON line: test_optimize runs it under ``python -O``.

Usage: python -O -m isolated.optimized TWIN_MODULE
"""

from __future__ import annotations

import importlib
import json
import sys

from kvqueue import KVCacheBlock

from support.invalid_ops import CASES, outcome

mod = importlib.import_module(sys.argv[1])
results: dict[str, object] = {name: outcome(mod, name) for name in CASES}
block = KVCacheBlock(0)
block.set_block_hash(b"h")
try:
    block.set_block_hash(b"i")
    results["set_block_hash_twice"] = "no exception"
except AssertionError as exc:
    results["set_block_hash_twice"] = str(exc)
print(json.dumps(results))
