"""vLLM's module names and a stand-in for its queue class, for the tests that install kvqueue
into a fake vLLM module tree."""

from __future__ import annotations

import textwrap
from types import ModuleType
from typing import Any

UTILS = "vllm.v1.core.kv_cache_utils"
POOL = "vllm.v1.core.block_pool"
MANAGER = "vllm.v1.core.kv_cache_manager"


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


# A stand-in for vLLM's KVCacheManager: its managers list each request's blocks, and the
# scheduler calls new_step_starts() first in every step.
MANAGER_SOURCE = textwrap.dedent(
    """
    from collections import defaultdict

    class SingleTypeManager:
        def __init__(self, block_pool):
            self.block_pool = block_pool
            self.req_to_blocks = defaultdict(list)

    class Coordinator:
        def __init__(self, block_pool, num_managers):
            self.block_pool = block_pool
            self.single_type_managers = tuple(
                SingleTypeManager(block_pool) for _ in range(num_managers)
            )

    class KVCacheManager:
        def __init__(self, block_pool, num_managers=1):
            self.block_pool = block_pool
            self.coordinator = Coordinator(block_pool, num_managers)
            self.steps = 0

        def new_step_starts(self):
            self.steps += 1
    """
)


def manager_module() -> ModuleType:
    """A module named as vLLM's ``kv_cache_manager``, defining the stand-in above."""
    module = ModuleType(MANAGER)
    exec(compile(MANAGER_SOURCE, "<fake kv_cache_manager>", "exec"), module.__dict__)
    return module
