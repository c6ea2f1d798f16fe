"""The double free that corrupts a serving engine's free list, on vLLM's real BlockPool.

Run with pytest in the vLLM venv (vllm_tests/venv.sh). Every pool here is vLLM 0.33's own
``BlockPool``, built as vLLM builds it; only the queue class it picks up changes:

* ``vllm``: vLLM's own ``FreeKVCacheBlockQueue``;
* ``cython`` / ``python``: ``kvqueue.vllm.install(...)`` before the pool is built, with the
  misuse policy given by ``KVQUEUE_ON_MISUSE`` (what a pool built inside vLLM reads).

The corrupting case: a block that is free (linked in the queue) gets a reference from a path
that bypasses ``BlockPool.touch()`` (which would unlink it), then is freed again: its
``ref_cnt`` drops to 0 and the pool links it a second time. Paths in vLLM that reach the
queue this way, and those that cannot: /work/notes/double_free_paths.md.
"""

from __future__ import annotations

import inspect
import os
import random
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

# Importing vLLM imports torch, whose import-time DeprecationWarnings are not ours to fail on
# (the repository's pytest settings turn warnings into errors).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("vllm")
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.block_pool import BlockPool
kvqueue_vllm = pytest.importorskip("kvqueue.vllm")

NUM_BLOCKS = 8  # the null block, and 7 a request can get
KVQUEUE = ["cython", "python"]
MODULES = {"cython": "kvqueue._queue", "python": "kvqueue._queue_py"}


@contextmanager
def queue_of(kind: str, policy: str | None, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Pools built inside use ``kind``'s queue; the previous install state comes back after."""
    was = kvqueue_vllm.installed()
    if policy is None:
        monkeypatch.delenv("KVQUEUE_ON_MISUSE", raising=False)
    else:
        monkeypatch.setenv("KVQUEUE_ON_MISUSE", policy)
    if kind == "vllm":
        kvqueue_vllm.uninstall()
    else:
        kvqueue_vllm.install(kind)
    try:
        yield
    finally:
        if was is None:
            kvqueue_vllm.uninstall()
        else:
            kvqueue_vllm.install(was)


def new_pool(
    kind: str, policy: str | None, monkeypatch: pytest.MonkeyPatch, num_blocks: int = NUM_BLOCKS
) -> Any:
    with queue_of(kind, policy, monkeypatch):
        pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)
    queue = pool.free_block_queue
    if kind == "vllm":
        assert type(queue) is kv_cache_utils.FreeKVCacheBlockQueue
    else:
        assert type(queue).__module__ == MODULES[kind]
        if policy is not None:
            if not hasattr(queue, "on_misuse"):
                pytest.skip("this kvqueue has no misuse policy")
            assert queue.on_misuse == policy
    return pool


def linked_ids(pool: Any, limit: int = 4 * NUM_BLOCKS) -> list[int]:
    """The free list read link by link from the queue's head (bounded: it may be a cycle)."""
    queue = pool.free_block_queue
    ids = []
    block = queue.fake_free_list_head.next_free_block
    while block is not None and block is not queue.fake_free_list_tail and len(ids) < limit:
        ids.append(block.block_id)
        block = block.next_free_block
    return ids


def truly_free(pool: Any) -> list[int]:
    """The blocks no request holds: ref_cnt 0, null block aside."""
    return sorted(b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null)


def double_free(pool: Any) -> tuple[list[Any], Any]:
    """The issue's sequence: free a block, take a reference without touch(), free it again."""
    blocks = pool.get_new_blocks(3)
    pool.free_blocks([blocks[0]])
    blocks[0].ref_cnt += 1
    return blocks, lambda: pool.free_blocks([blocks[0]])


# -- vLLM's own queue: silent corruption, a bare assertion later ---------------------------


def test_vllm_queue_double_free_corrupts_the_list_silently(monkeypatch):
    pool = new_pool("vllm", None, monkeypatch)
    blocks, second_free = double_free(pool)
    second_free()  # returns normally
    free = truly_free(pool)
    assert len(free) == NUM_BLOCKS - 1 - 2
    assert pool.get_num_free_blocks() == len(free) + 1
    # prepend_n linked the block before itself: the list now cycles on it.
    assert blocks[0].next_free_block is blocks[0]
    assert linked_ids(pool)[:3] == [blocks[0].block_id] * 3
    handed = pool.get_new_blocks(1)
    assert handed == [blocks[0]]
    with pytest.raises(AssertionError) as failure:
        pool.get_new_blocks(1)
    assert str(failure.value) == ""  # a bare assert in get_new_blocks, far from the cause
    assert failure.traceback[-1].name == "get_new_blocks"


def test_vllm_queue_without_asserts_hands_one_block_to_many_requests(tmp_path):
    """Under ``python -O`` the assertion is gone: the same block goes to every request."""
    script = tmp_path / "double_free.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import kvqueue.vllm
            kvqueue.vllm.uninstall()
            from vllm.v1.core.block_pool import BlockPool
            pool = BlockPool(num_gpu_blocks={NUM_BLOCKS}, enable_caching=True, hash_block_size=16)
            blocks = pool.get_new_blocks(3)
            pool.free_blocks([blocks[0]])
            blocks[0].ref_cnt += 1
            pool.free_blocks([blocks[0]])
            print(blocks[0].block_id, [pool.get_new_blocks(1)[0].block_id for _ in range(4)])
            """
        )
    )
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("KVQUEUE_ON_MISUSE", None)
    out = subprocess.run(
        [sys.executable, "-O", str(script)], capture_output=True, text=True, env=env, check=True
    ).stdout.split("\n")[-2]
    first, handed = out.split(" ", 1)
    assert handed == repr([int(first)] * 4)


# -- kvqueue, on_misuse="raise": the second free is refused, nothing is corrupted -----------


def assert_pool_whole(pool: Any) -> None:
    """Count, list and ref counts agree, and the pool hands each free block out once."""
    free = truly_free(pool)
    assert sorted(linked_ids(pool)) == free
    assert pool.get_num_free_blocks() == len(free)
    assert sorted(b.block_id for b in pool.get_new_blocks(len(free))) == free
    with pytest.raises(ValueError, match="Cannot get 1 free blocks"):
        pool.get_new_blocks(1)


@pytest.mark.parametrize("kind", KVQUEUE)
def test_kvqueue_refuses_the_second_free(kind, monkeypatch):
    pool = new_pool(kind, None, monkeypatch)
    blocks, second_free = double_free(pool)
    with pytest.raises(ValueError, match=rf"already linked.*block_id={blocks[0].block_id}\b"):
        second_free()
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1 - 2
    assert_pool_whole(pool)


@pytest.mark.parametrize("kind", KVQUEUE)
def test_kvqueue_raise_is_the_default_and_explicit(kind, monkeypatch):
    pool = new_pool(kind, "raise", monkeypatch)
    _, second_free = double_free(pool)
    with pytest.raises(ValueError, match="already linked"):
        second_free()
    assert_pool_whole(pool)


# -- the other pool entry that links blocks: unpin_blocks (vLLM 0.33, HiSparse) ------------


@pytest.mark.parametrize("kind", ["vllm", *KVQUEUE])
def test_unpin_after_free_links_the_block_twice(kind, monkeypatch):
    pool = new_pool(kind, None, monkeypatch)
    blocks = pool.get_new_blocks(3)
    pool.unpin_blocks([blocks[1]], on_reuse=lambda block: None)
    blocks[1].ref_cnt += 1  # a reference taken without touch()
    if kind == "vllm":
        pool.unpin_blocks([blocks[1]], on_reuse=lambda block: None)
        assert pool.get_num_free_blocks() == len(truly_free(pool)) + 1
        assert blocks[1].prev_free_block is blocks[1]  # append_n linked it after itself
    else:
        with pytest.raises(ValueError, match=rf"block_id={blocks[1].block_id}\b"):
            pool.unpin_blocks([blocks[1]], on_reuse=lambda block: None)
        assert_pool_whole(pool)


# -- a consequence: reset_prefix_cache trusts the count ----------------------------------


@pytest.mark.parametrize("kind", ["vllm", *KVQUEUE])
def test_reset_prefix_cache_after_a_double_free(kind, monkeypatch):
    """With an inflated count, vLLM resets the prefix cache while a request holds a block."""
    pool = new_pool(kind, None, monkeypatch)
    first, held = pool.get_new_blocks(2)
    pool.free_blocks([first])
    first.ref_cnt += 1
    if kind == "vllm":
        pool.free_blocks([first])
        assert held.ref_cnt == 1
        assert pool.reset_prefix_cache() is True  # "all blocks are free"
    else:
        with pytest.raises(ValueError, match="already linked"):
            pool.free_blocks([first])
        assert pool.reset_prefix_cache() is False  # one block is still in use


# -- what no queue can see: a duplicate inside one free_blocks call --------------------------


@pytest.mark.parametrize("kind", ["vllm", *KVQUEUE])
def test_duplicate_in_one_call_leaves_a_negative_count_no_queue_sees(kind, monkeypatch):
    """vLLM decrements per occurrence and links at 0 only, so the queue gets the block once
    and is never misused; but ``ref_cnt`` ends at -1, a later prefix hit (``touch``) takes
    the block without unlinking it, and the next allocation hands it to a second request.
    kvqueue cannot catch this: every queue call is valid.
    """
    pool = new_pool(kind, None, monkeypatch)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block, block])
    assert block.ref_cnt == -1
    assert linked_ids(pool).count(block.block_id) == 1
    pool.touch([block])  # request A hits it in the prefix cache: ref_cnt -1 -> 0, still linked
    assert block.block_id in linked_ids(pool)
    handed = pool.get_new_blocks(pool.get_num_free_blocks())
    assert block in handed  # request B gets the block A holds
    assert pool.get_num_free_blocks() == 0


# -- kvqueue, on_misuse="repair": the engine keeps going, the pool stays true -----------------


@pytest.mark.parametrize("kind", KVQUEUE)
def test_repair_skips_the_second_free(kind, monkeypatch):
    pool = new_pool(kind, "repair", monkeypatch)
    _, second_free = double_free(pool)
    second_free()
    assert pool.free_block_queue.repairs["linked"] == 1
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1 - 2
    assert_pool_whole(pool)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kind", KVQUEUE)
def test_repair_under_load_never_hands_a_block_to_two_requests(kind, seed, monkeypatch):
    """Seeded requests allocate and free blocks (hashed ones too, so frees go to both ends
    of the queue and prefix hits take blocks out of its middle), with double frees injected
    through ``free_blocks`` and ``unpin_blocks``. After every operation: count = list = blocks
    with ref_cnt 0, and no block is held by two requests.
    """
    rng = random.Random(seed)
    pool = new_pool(kind, "repair", monkeypatch, num_blocks=64)
    queue = pool.free_block_queue
    held: dict[int, list[Any]] = {}  # request -> its blocks
    holder: dict[int, set[int]] = {}  # block id -> requests holding it
    injected = 0
    for step in range(2000):
        action = rng.random()
        free_now = pool.get_num_free_blocks()
        if action < 0.35 and free_now:
            blocks = pool.get_new_blocks(rng.randint(1, min(free_now, 4)))
            for block in blocks:
                assert not holder.get(block.block_id), f"block {block.block_id} handed out twice"
                if rng.random() < 0.5:  # a full block, cached: freed to the queue's tail
                    block_hash = kv_cache_utils.BlockHash(rng.randbytes(8))
                    block.set_block_hash(
                        kv_cache_utils.make_block_hash_with_group_id(block_hash, 0)
                    )
            held[step] = blocks
        elif action < 0.45 and held:
            # A prefix hit: a block some request holds, or a free one (the middle of the queue).
            candidates = [b for b in pool.blocks[1:] if b.ref_cnt >= 0]
            block = rng.choice(candidates)
            if block.ref_cnt == 0 and holder.get(block.block_id):
                continue
            pool.touch([block])
            held[step] = [block]
        elif action < 0.8 and held:
            request = rng.choice(list(held))
            blocks = held.pop(request)
            for block in blocks:
                holder[block.block_id].discard(request)
            pool.free_blocks(reversed(blocks))
        else:
            # The bug: a free block gets a reference without touch() and is freed again.
            linked = [b for b in pool.blocks[1:] if b.ref_cnt == 0]
            if not linked:
                continue
            block = rng.choice(linked)
            block.ref_cnt += 1
            if rng.random() < 0.5:
                pool.free_blocks([block])
            else:
                pool.unpin_blocks([block], on_reuse=lambda b: None)
            injected += 1
        for request, blocks in held.items():
            for block in blocks:
                holder.setdefault(block.block_id, set()).add(request)
        free = truly_free(pool)
        assert pool.get_num_free_blocks() == len(free)
        assert sorted(b.block_id for b in queue.get_all_free_blocks()) == free
        for block_id, requests in holder.items():
            assert not (requests and block_id in free), f"block {block_id} held and free"
        assert queue.repairs["linked"] == injected
    assert injected > 50


@pytest.mark.parametrize("kind", KVQUEUE)
def test_install_can_choose_repair_without_the_environment(kind, monkeypatch):
    if "on_misuse" not in inspect.signature(kvqueue_vllm.install).parameters:
        pytest.skip("this kvqueue.vllm.install() takes no on_misuse")
    monkeypatch.delenv("KVQUEUE_ON_MISUSE", raising=False)
    was = kvqueue_vllm.installed()
    kvqueue_vllm.install(kind, on_misuse="repair")
    try:
        pool = BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=True, hash_block_size=16)
    finally:
        if was is None:
            kvqueue_vllm.uninstall()
        else:
            kvqueue_vllm.install(was)
    assert type(pool.free_block_queue).__module__ == MODULES[kind]
    _, second_free = double_free(pool)
    second_free()
    assert pool.free_block_queue.repairs["linked"] == 1
    assert_pool_whole(pool)
