"""The queues under comparison, all threading the same ``kvqueue.KVCacheBlock`` class."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import baseline
import vllm_source

from kvqueue import KVCacheBlock

# vLLM 0.30.0 is the seed's baseline: every ratio is taken against it. 0.33.0 is the first
# release with the local-variable / singleton optimisation.
VLLM_VERSIONS = {"vllm-0.30": "0.30.0", "vllm-0.33": "0.33.0"}
REFERENCE = "vllm-0.30"
# With no vLLM (--quick), ratios are taken against the pure twin instead.
FALLBACK_REFERENCE = "pure"
DEQUE = "deque"
ALL = ("vllm-0.30", "vllm-0.33", "pure", "cython", DEQUE)
QUICK = ("pure", "cython", DEQUE)
TWINS = {"pure": "_queue_py", "cython": "_queue"}


@dataclass(frozen=True)
class Contender:
    name: str
    # None for the deque, which is not a block queue: each case spells out its deque cycle.
    queue_class: type | None
    origin: str


def load(name: str, *, download: bool) -> Contender:
    """The contender ``name``; LookupError (with the reason) when it cannot be had."""
    if name == DEQUE:
        return Contender(name, None, "collections.deque")
    twin, at, rev = name.partition("@")
    if twin in TWINS:
        # ``pure@REV`` / ``cython@REV``: that twin as it was at git revision REV.
        module = baseline.module(rev, TWINS[twin]) if at else f"kvqueue.{TWINS[twin]}"
        try:
            queue_class = importlib.import_module(module).FreeKVCacheBlockQueue
        except ImportError as exc:
            raise LookupError(f"{module} is not importable ({exc})") from exc
        return Contender(name, queue_class, f"{module} at {rev}" if at else module)
    version = VLLM_VERSIONS.get(name)
    if version is None:
        raise LookupError(f"unknown contender {name!r} (known: {', '.join(ALL)})")
    if not download and not vllm_source.is_cached(version):
        raise LookupError(f"vllm {version} is not in {vllm_source.cache_dir()} (no download)")
    queue_class = vllm_source.load_queue_class(version, KVCacheBlock)
    return Contender(name, queue_class, f"vllm {version} wheel, {vllm_source.QUEUE_FILE}")
