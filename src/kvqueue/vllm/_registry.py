"""What kvqueue guards in vLLM, said once: each ``BlockPool`` method the guard wraps with the
misuses its rule refuses or repairs, and the ``KVCacheManager`` method the holder audit runs
in with what the audit finds.

The guard wraps these names, the metrics declare one counter per method and misuse, the lines'
table and its checks read each line's methods by them, and ``python -m kvqueue`` reports them:
a new guarded method or misuse is written here, and each of those follows.
"""

from __future__ import annotations

from .._policy import AUDIT_MISUSES, PoolMisuse

__all__ = ("AUDIT_HOOK", "CORRECTED", "ENTRY", "GUARDED", "KINDS")

#: The guarded ``BlockPool`` methods, in the order a request meets them, each with the
#: misuses its rule refuses (``"raise"``) or repairs (``"repair"``).
GUARDED: dict[str, tuple[PoolMisuse, ...]] = {
    "get_new_blocks": ("held_free", "negative_ref", "listed_free"),
    "touch": ("negative_ref", "listed_free"),
    "free_blocks": ("double_free", "held_free", "listed_free", "under_counted"),
    "unpin_blocks": ("double_free", "held_free"),
}
#: The ``KVCacheManager`` method the holder audit runs in: the first the scheduler calls in a
#: step, before any block is counted free for a request or handed out.
AUDIT_HOOK = "new_step_starts"
#: The free list's entry: the methods of kvqueue's queue that link blocks, each with what its
#: gate refuses or repairs when called by anything but a guarded free (a block that holds a
#: reference, a block a live request lists).
ENTRY: dict[str, tuple[PoolMisuse, ...]] = dict.fromkeys(
    ("append", "append_n", "prepend_n"), ("held_free", "listed_free")
)
#: What each method can refuse or repair, the audit's hook with what the audit finds.
KINDS: dict[str, tuple[PoolMisuse, ...]] = {**GUARDED, **ENTRY, AUDIT_HOOK: AUDIT_MISUSES}
#: What kvqueue corrects with the guard off, on a line that counts first (vLLM 0.18-0.23):
#: its ``free_blocks`` queues a block once per occurrence, which kvqueue's queue refuses after
#: vLLM released every count (the block would be lost), where the guard queues it once.
CORRECTED = ("free_blocks",)
