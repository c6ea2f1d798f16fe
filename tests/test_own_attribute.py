"""kvqueue reads vLLM's pools' and managers' attributes without asking for their ``__dict__``
(``kvqueue.vllm._own``): on CPython 3.11 and 3.12 an object whose ``__dict__`` was asked for
reads every attribute the slower way for the rest of its life, and vLLM's pools and managers
read theirs throughout every step. Both twins: the holder index adopts a manager, and its
table checks it is in place, with the twin's screens."""

from __future__ import annotations

import gc
import sys
from collections import defaultdict
from types import ModuleType
from typing import Any

import pytest

from kvqueue.vllm import _index
from kvqueue.vllm._own import own_attribute

# Where an object keeps its attributes in place until its __dict__ is asked for, and the
# collector's view shows which: the dict, once made, is what the object refers to.
IN_PLACE = sys.implementation.name == "cpython" and (3, 11) <= sys.version_info[:2] <= (3, 12)


def made_dict(obj: object, names: set[str]) -> bool:
    """Whether ``obj`` refers to a dict of exactly its attributes ``names``: its ``__dict__``
    was made."""
    return any(type(r) is dict and set(r) == names for r in gc.get_referents(obj))


class Pool:
    def __init__(self, n: int) -> None:
        self.blocks = [Block(i) for i in range(n)]
        self.enable_caching = True


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0


class Manager:
    def __init__(self, block_pool: Any) -> None:
        self.block_pool = block_pool
        self.req_to_blocks: Any = defaultdict(list)


class Slotted:
    __slots__ = ("blocks",)

    def __init__(self) -> None:
        self.blocks = [1]


class Shadowed:
    blocks: Any = "the class's"

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"__getattr__ ran for {name}")


class Property:
    @property
    def blocks(self) -> Any:
        raise AssertionError("the property ran")


def test_reads_what_vars_reads() -> None:
    pool = Pool(2)
    assert own_attribute(pool, "blocks") is pool.blocks
    assert own_attribute(pool, "missing") is None
    assert own_attribute(None, "blocks") is None
    assert own_attribute(Slotted(), "blocks") is None  # no __dict__: vars() has none
    shadowed = Shadowed()
    assert own_attribute(shadowed, "blocks") is None  # the class's is not the object's
    shadowed.blocks = "its own"
    assert own_attribute(shadowed, "blocks") == "its own"
    assert own_attribute(shadowed, "missing") is None  # no __getattr__
    assert own_attribute(Property(), "blocks") is None  # no property


@pytest.mark.skipif(not IN_PLACE, reason="attributes in place: CPython 3.11 and 3.12")
def test_asks_for_no_dict() -> None:
    pool, other = Pool(2), Pool(2)
    names = {"blocks", "enable_caching"}
    assert own_attribute(pool, "blocks") is pool.blocks
    assert not made_dict(pool, names)
    vars(other)  # the check's own control: asked for, the dict is made, and seen
    assert made_dict(other, names)


@pytest.mark.skipif(not IN_PLACE, reason="attributes in place: CPython 3.11 and 3.12")
def test_the_index_asks_for_no_managers_or_pools_dict(screen: ModuleType) -> None:
    pool = Pool(8)
    manager = Manager(pool)
    _index.adopt(manager, None, screen)
    table = manager.req_to_blocks
    assert type(table) is screen.Table
    table["A"].extend(pool.blocks[:2])
    assert table.in_place()
    assert _index.index_of(pool) is not None
    assert not made_dict(manager, {"block_pool", "req_to_blocks"})
    assert not made_dict(pool, {"blocks", "enable_caching"})
