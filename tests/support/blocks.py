"""Block classes the suite threads: kvqueue's own, one shaped like vLLM's, and other layouts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, make_dataclass
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


# Every field a vLLM line's block has had (and one none has), with its type and default: a
# layout is a choice of them, in order.
_FIELDS: dict[str, tuple[Any, Callable[[], Any] | None]] = {
    "block_id": (int, None),
    "ref_cnt": (int, lambda: 0),
    "pool": (Any, lambda: field(default=None, repr=False, compare=False, kw_only=True)),
    "_block_hash": (Any, lambda: None),
    "_block_hash_num_tokens": (int | None, lambda: None),
    "block_hash": (Any, lambda: None),
    "block_hash_num_tokens": (int | None, lambda: None),
    "prev_free_block": (Any, lambda: None),
    "next_free_block": (Any, lambda: None),
    "is_null": (bool, lambda: False),
    "last_access": (float, lambda: 0.0),
}


def layout(name: str, fields: Sequence[str], *, slots: bool = True) -> type:
    """A dataclass block class ``name`` with ``fields`` in that order (``slots``: as vLLM's)."""
    spec: list[Any] = []
    for each in fields:
        kind, default = _FIELDS[each]
        spec.append((each, kind) if default is None else (each, kind, default()))
    made = make_dataclass(name, spec, slots=slots)
    made.__module__ = __name__
    return made
