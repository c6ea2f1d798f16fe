"""Block classes the suite threads: kvqueue's own, and one shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvqueue import KVCacheBlock


@dataclass(slots=True)
class VllmStyleBlock:
    """vLLM's KVCacheBlock layout: a slotted dataclass with field-wise ``==``."""

    block_id: int
    ref_cnt: int = 0
    pool: Any = field(default=None, repr=False, compare=False, kw_only=True)
    _block_hash: Any = None
    _block_hash_num_tokens: int | None = None
    prev_free_block: VllmStyleBlock | None = None
    next_free_block: VllmStyleBlock | None = None
    is_null: bool = False


class SubBlock(KVCacheBlock):
    """A Python subclass with a slot of its own."""

    __slots__ = ("extra",)
    extra: str


BLOCK_CLASSES = (KVCacheBlock, VllmStyleBlock)
