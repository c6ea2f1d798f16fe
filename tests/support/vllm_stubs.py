"""vLLM's module names and a stand-in for its queue class, for the tests that install kvqueue
into a fake vLLM module tree."""

from __future__ import annotations

from typing import Any

UTILS = "vllm.v1.core.kv_cache_utils"
POOL = "vllm.v1.core.block_pool"


def as_vllms(cls: type) -> type:
    """Make ``cls`` and its methods look defined in vLLM's module, as vLLM's own queue is
    (kvqueue refuses a queue class another module patched)."""
    cls.__module__ = UTILS
    for value in vars(cls).values():
        if callable(value):
            value.__module__ = UTILS
    return cls


@as_vllms
class VllmQueue:
    """Stands in for vLLM's own queue: the public API is what the drop-in compares."""

    def __init__(self, blocks: list[Any]) -> None:
        self.blocks = blocks

    def popleft(self) -> Any:
        return self.blocks[0]

    def popleft_n(self, n: int) -> Any: ...
    def remove(self, block: Any) -> None: ...
    def append(self, block: Any) -> None: ...
    def prepend_n(self, blocks: Any) -> None: ...
    def append_n(self, blocks: Any) -> None: ...
    def get_all_free_blocks(self) -> Any: ...
    def iter_blocks_after(self, cursor: Any) -> Any: ...
