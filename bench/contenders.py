"""The queues under comparison, all threading the same ``kvqueue.KVCacheBlock`` class."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import baseline
import vllm_source

from kvqueue import KVCacheBlock


def _name(version: str) -> str:
    return "vllm-" + ".".join(version.split(".")[:2])


# vLLM 0.30.0 is the seed's baseline: every ratio is taken against it. Beside it, the release
# vllm_tests/vllm.env pins (newer ones have a local-variable / single-block fast path).
REFERENCE, PINNED = _name("0.30.0"), _name(vllm_source.sdist().VLLM_VERSION)
VLLM_VERSIONS = {REFERENCE: "0.30.0", PINNED: vllm_source.sdist().VLLM_VERSION}
# With no vLLM (--quick), ratios are taken against the pure twin instead.
FALLBACK_REFERENCE = "pure"
DEQUE = "deque"
ALL = (*VLLM_VERSIONS, "pure", "cython", DEQUE)
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
        raise LookupError(f"vllm {version}'s sources are not cached (no download)")
    queue_class = vllm_source.load_queue_class(version, KVCacheBlock)
    return Contender(name, queue_class, f"vllm {version} sdist, {vllm_source.QUEUE_FILE}")
