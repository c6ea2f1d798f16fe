"""KVCacheBlock: vLLM's fields, repr and hash rules, as a slotted class."""

from __future__ import annotations

import pickle
import weakref

import pytest

from kvqueue import KVCacheBlock
from kvqueue.vllm._lines import LINES

from support.blocks import SubBlock

# kvqueue's own block keeps the private hash fields (with read-only properties) of the
# newest line that has them; vLLM 0.34+ made them public (vLLM's own blocks: vllm_tests/).
FIELDS = next(line for line in reversed(LINES) if "_block_hash" in line.block_fields).block_fields


def test_defaults() -> None:
    block = KVCacheBlock(3)
    assert (block.block_id, block.ref_cnt, block.pool, block.is_null) == (3, 0, None, False)
    assert block.block_hash is None
    assert block.block_hash_num_tokens is None
    assert block.prev_free_block is None
    assert block.next_free_block is None


def test_constructor_matches_the_dataclass_signature() -> None:
    pool = object()
    block = KVCacheBlock(1, 2, b"h", 16, None, None, True, pool=pool)
    assert (block.ref_cnt, block.block_hash, block.block_hash_num_tokens) == (2, b"h", 16)
    assert block.is_null is True
    assert block.pool is pool
    with pytest.raises(TypeError):
        KVCacheBlock(1, 2, None, None, None, None, False, pool)  # type: ignore[call-arg]


def test_fields_are_slots_and_assignable() -> None:
    block = KVCacheBlock(0)
    assert not hasattr(block, "__dict__")
    for name in FIELDS:
        assert name in KVCacheBlock.__slots__
        setattr(block, name, 5)
        assert getattr(block, name) == 5
    with pytest.raises(AttributeError):
        block.unknown = 1  # type: ignore[attr-defined]


def test_block_hash_properties_are_read_only() -> None:
    block = KVCacheBlock(0)
    with pytest.raises(AttributeError):
        block.block_hash = b"x"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        block.block_hash_num_tokens = 1  # type: ignore[misc]


def test_set_and_reset_hash() -> None:
    block = KVCacheBlock(0)
    block.set_block_hash(b"abc", 16)
    assert (block.block_hash, block.block_hash_num_tokens) == (b"abc", 16)
    with pytest.raises(
        AssertionError, match=r"^The block already has a hash\. This should not happen\.$"
    ):
        block.set_block_hash(b"def")
    assert block.block_hash == b"abc"
    block.reset_hash()
    assert (block.block_hash, block.block_hash_num_tokens) == (None, None)
    block.set_block_hash(b"def")
    assert (block.block_hash, block.block_hash_num_tokens) == (b"def", None)


def test_set_block_hash_refuses_a_leftover_token_count() -> None:
    block = KVCacheBlock(0)
    block._block_hash_num_tokens = 8
    with pytest.raises(AssertionError):
        block.set_block_hash(b"abc")


def test_repr_is_vllms() -> None:
    a, b, c = KVCacheBlock(1, 2), KVCacheBlock(2), KVCacheBlock(3)
    b.prev_free_block, b.next_free_block = a, c
    b.set_block_hash(("h", 0), 16)
    assert repr(b) == (
        "KVCacheBlock(block_id=2, ref_cnt=0, _block_hash=('h', 0), "
        "_block_hash_num_tokens=16, prev_free_block=1, next_free_block=3)"
    )
    assert str(a) == (
        "KVCacheBlock(block_id=1, ref_cnt=2, _block_hash=None, "
        "_block_hash_num_tokens=None, prev_free_block=None, next_free_block=None)"
    )


def test_equality_and_hash_are_by_identity() -> None:
    a, b = KVCacheBlock(1), KVCacheBlock(1)
    assert a != b
    assert a == a
    assert len({a, b}) == 2
    assert hash(a) == object.__hash__(a)


def test_subclass_and_weakref_and_pickle() -> None:
    sub = SubBlock(4)
    sub.extra = "x"
    assert isinstance(sub, KVCacheBlock)
    assert weakref.ref(sub)() is sub
    clone = pickle.loads(pickle.dumps(KVCacheBlock(7, 1)))
    assert (clone.block_id, clone.ref_cnt, clone.prev_free_block) == (7, 1, None)


def test_match_args() -> None:
    match KVCacheBlock(5, 1):
        case KVCacheBlock(block_id, ref_cnt):
            assert (block_id, ref_cnt) == (5, 1)
