"""Double frees on vLLM's real BlockPool: what vLLM alone does, and kvqueue's pool guard.

Run with pytest in the vLLM venv (vllm_tests/venv.sh). Every pool here is vLLM's own
``BlockPool``, built as vLLM builds it; what changes is what ``kvqueue.vllm.install()`` put in:

* ``vllm``: nothing (vLLM's own queue and methods);
* ``cython`` / ``python``: kvqueue's queue and pool guard, with the misuse policy given by
  ``KVQUEUE_ON_MISUSE`` (what a pool built inside vLLM reads).

The two forms: a block freed twice in one ``free_blocks()`` call (vLLM issue 42571: its
``ref_cnt`` goes 1, 0, -1, no queue call is wrong, and a later prefix hit gives it a second
holder), and a free block freed again (after a reference taken without ``touch()``, or
directly), which links it twice in vLLM's list. The vLLM paths that can reach each form:
vllm_tests/DOUBLE_FREE.md.

The pool is whichever vLLM line is importable (``make vllm-tests VLLM=0.31.0`` lays that line
over the venv, vllm_tests/lines.py); what the line has is read from ``kvqueue.vllm._lines``:
0.18-0.23 count every occurrence first and queue at 0 (a duplicate held once is lost, one held
twice is queued twice) and append what they free; later lines classify inside the loop and
prepend an unhashed block; ``unpin_blocks`` and blocks naming their pool come with 0.30.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import re
import subprocess
import sys
import textwrap
import warnings
from importlib.metadata import version
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
from kvqueue.vllm._lines import find  # noqa: E402

from support.helpers import one_line, raises_said  # noqa: E402

LINE = find(version("vllm"))
assert LINE is not None, f"vLLM {version('vllm')} is not a line kvqueue accepts"
HAS_UNPIN = "unpin_blocks" in LINE.pool_methods
needs_unpin = pytest.mark.skipif(not HAS_UNPIN, reason=f"vLLM {LINE.name} has no unpin_blocks")

NUM_BLOCKS = 8  # the null block, and 7 a request can get
KVQUEUE = ["cython", "python"]
MODULES = {"cython": "kvqueue._queue", "python": "kvqueue._queue_py"}
pytestmark = pytest.mark.usefixtures("kept_install")


def new_pool(
    kind: str,
    policy: str | None,
    monkeypatch: pytest.MonkeyPatch,
    num_blocks: int = NUM_BLOCKS,
    pool_guard: bool = True,
) -> Any:
    """A pool with ``kind``'s queue, and for kvqueue its guard (unless not ``pool_guard``),
    installed until the test ends."""
    if policy is None:
        monkeypatch.delenv("KVQUEUE_ON_MISUSE", raising=False)
    else:
        monkeypatch.setenv("KVQUEUE_ON_MISUSE", policy)
    if kind == "vllm":
        kvqueue_vllm.uninstall()
    else:
        kvqueue_vllm.install(kind, pool_guard=pool_guard)
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


@pytest.mark.skipif(LINE.counts_first, reason="0.18-0.23 append: the test after this one")
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


@pytest.mark.skipif(not LINE.counts_first, reason="from 0.24 an unhashed block is prepended")
def test_vllm_counting_first_hands_out_the_queues_own_tail(monkeypatch):
    """0.18-0.23 append what they free: the block is linked after itself at the tail, the list
    reads it once, the count has one more, and the allocation past the list hands out the
    queue's sentinel tail (``block_id`` -1) as a block, with no assertion on the way."""
    pool = new_pool("vllm", None, monkeypatch)
    blocks, second_free = double_free(pool)
    second_free()
    free = truly_free(pool)
    assert blocks[0].prev_free_block is blocks[0]
    assert sorted(linked_ids(pool)) == free
    assert pool.get_num_free_blocks() == len(free) + 1
    handed = [pool.get_new_blocks(1)[0] for _ in range(len(free) + 1)]
    assert handed[-2] is blocks[0]
    assert handed[-1] is pool.free_block_queue.fake_free_list_tail
    assert handed[-1].block_id == -1


@pytest.mark.skipif(LINE.counts_first, reason="0.18-0.23 assert nothing on the way (test above)")
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
    message = (
        rf"free_blocks\(\) was given block {blocks[0].block_id} .*free list already.*double free"
    )
    with raises_said(ValueError, message) as refused:
        second_free()
    assert re.search(
        r"called from \S*/test_double_free.py:\d+ in <lambda>$", one_line(refused.value)
    )
    # Refused before vLLM's own method ran: the state the bug made, unchanged.
    assert blocks[0].ref_cnt == 1
    assert linked_ids(pool).count(blocks[0].block_id) == 1
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1 - 2


@pytest.mark.parametrize("kind", KVQUEUE)
def test_kvqueue_raise_is_the_default_and_explicit(kind, monkeypatch):
    pool = new_pool(kind, "raise", monkeypatch)
    _, second_free = double_free(pool)
    with raises_said(ValueError, "double free"):
        second_free()
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1 - 2


# -- the other pool entry that links blocks: unpin_blocks (vLLM 0.30+, HiSparse) ----------


@needs_unpin
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
        with raises_said(ValueError, rf"unpin_blocks\(\) was given block {blocks[1].block_id} "):
            pool.unpin_blocks([blocks[1]], on_reuse=lambda block: None)
        assert blocks[1].ref_cnt == 1


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
        with raises_said(ValueError, "double free"):
            pool.free_blocks([first])
        assert pool.reset_prefix_cache() is False  # one block is still in use


# -- issue 42571: a duplicate inside one free_blocks call, which no queue call shows ------------


def two_holders(pool: Any) -> tuple[Any, list[Any]]:
    """Free a held block twice in one call, let request A hit it in the prefix cache
    (``touch``), then give request B every free block; return the block and B's blocks."""
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block, block])
    pool.touch([block])
    return block, pool.get_new_blocks(pool.get_num_free_blocks())


@pytest.mark.skipif(LINE.counts_first, reason="0.18-0.23 lose the block instead (tests below)")
def test_vllm_alone_gives_one_block_two_holders(monkeypatch):
    """vLLM decrements per occurrence and links at 0 only: ``ref_cnt`` ends at -1 with every
    queue call valid, ``touch`` takes it to 0 without unlinking it, and the next
    allocation hands the block A holds to B."""
    pool = new_pool("vllm", None, monkeypatch)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block, block])
    assert block.ref_cnt == -1
    assert linked_ids(pool).count(block.block_id) == 1
    pool.free_blocks([])  # nothing else notices
    pool.touch([block])
    assert block.ref_cnt == 0
    assert block.block_id in linked_ids(pool)
    handed = pool.get_new_blocks(pool.get_num_free_blocks())
    assert block in handed  # A holds it through touch, B through allocation: two holders
    assert block.ref_cnt == 1


@pytest.mark.skipif(not LINE.counts_first, reason="from 0.24 the block is linked at 0")
def test_vllm_counting_first_loses_a_block_listed_twice(monkeypatch):
    """0.18-0.23 decrement every occurrence before they queue those at 0: a block held once and
    listed twice ends at -1 and is never queued; nobody holds it, and no free ever brings it
    back (a holder's free takes it from 0 to -1 again)."""
    pool = new_pool("vllm", None, monkeypatch)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block, block])
    assert block.ref_cnt == -1
    assert block.block_id not in linked_ids(pool)
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 2  # one less than nobody holds
    pool.touch([block])  # a prefix hit: A holds it at ref_cnt 0
    assert block.ref_cnt == 0
    pool.free_blocks([block])
    assert block.ref_cnt == -1
    assert block.block_id not in linked_ids(pool)
    assert block not in pool.get_new_blocks(pool.get_num_free_blocks())


@pytest.mark.skipif(not LINE.counts_first, reason="from 0.24 the block is queued once")
def test_vllm_counting_first_queues_a_block_held_twice_and_listed_twice_twice(monkeypatch):
    pool = new_pool("vllm", None, monkeypatch)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.free_blocks([block, block])
    assert block.ref_cnt == 0
    assert block.prev_free_block is block  # appended after itself
    assert pool.get_num_free_blocks() == len(truly_free(pool)) + 1


@pytest.mark.skipif(not LINE.counts_first, reason="from 0.24 the block is queued once")
@pytest.mark.parametrize("pool_guard", [True, False])
@pytest.mark.parametrize("kind", KVQUEUE)
def test_kvqueue_queues_a_block_held_twice_and_listed_twice_once(kind, pool_guard, monkeypatch):
    """The queue refuses a block twice in one batch, after vLLM 0.18-0.23
    released every count; with the guard off too, it is queued once and not lost."""
    pool = new_pool(kind, "raise", monkeypatch, pool_guard=pool_guard)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.free_blocks([block, block])
    assert block.ref_cnt == 0
    assert block.block_id in linked_ids(pool)
    assert_pool_whole(pool)


@pytest.mark.parametrize("kind", KVQUEUE)
def test_guard_refuses_the_duplicate_at_the_faulty_call(kind, monkeypatch):
    pool = new_pool(kind, "raise", monkeypatch)
    (block,) = pool.get_new_blocks(1)
    before = linked_ids(pool)
    with raises_said(ValueError, rf"free_blocks\(\) was given block {block.block_id} 2 time"):
        pool.free_blocks([block, block])
    assert block.ref_cnt == 1
    assert linked_ids(pool) == before
    pool.free_blocks([block])
    assert_pool_whole(pool)


@pytest.mark.parametrize("kind", KVQUEUE)
def test_guard_repairs_the_duplicate(kind, monkeypatch, caplog):
    pool = new_pool(kind, "repair", monkeypatch)
    with caplog.at_level("WARNING", logger="kvqueue"):
        block, handed = two_holders(pool)
    assert block not in handed  # A keeps it alone
    assert block.ref_cnt == 1
    assert kvqueue_vllm.pool_repairs(pool)["double_free"] == 1
    # A record's lines, one line again.
    said = [" ".join(r.getMessage().split()) for r in caplog.records]
    (line,) = [each for each in said if "repaired a double free" in each]
    assert f"block {block.block_id}" in line
    assert "BlockPool.free_blocks()" in line


@pytest.mark.parametrize("policy", ["raise", "repair"])
@pytest.mark.parametrize("kind", KVQUEUE)
def test_negative_count_left_by_an_unguarded_free(kind, policy, monkeypatch):
    """A -1 made before the guard was on: ``touch`` and ``get_new_blocks`` see it."""
    pool = new_pool(kind, policy, monkeypatch)
    kvqueue_vllm.install(kind, pool_guard=False)
    try:
        (block,) = pool.get_new_blocks(1)
        pool.free_blocks([block, block])
    finally:
        kvqueue_vllm.install(kind)
    assert block.ref_cnt == -1
    # 0.18-0.23 never queued it (lost); later lines queued it at the first 0, so it is at the head.
    assert (block.block_id in linked_ids(pool)) is not LINE.counts_first
    if policy == "raise":
        with raises_said(
            ValueError, rf"touch\(\) was given block {block.block_id} whose ref_cnt is -1"
        ):
            pool.touch([block])
        if not LINE.counts_first:
            with raises_said(
                ValueError, rf"get_new_blocks\(\) would hand out block {block.block_id}"
            ):
                pool.get_new_blocks(1)
        assert block.ref_cnt == -1
    else:
        pool.touch([block])  # taken as 0: touch unlinks it, A holds it
        assert block.ref_cnt == 1
        assert block.block_id not in linked_ids(pool)
        assert block not in pool.get_new_blocks(pool.get_num_free_blocks())
        assert kvqueue_vllm.pool_repairs(pool)["negative_ref"] == 1


@pytest.mark.parametrize("policy", ["raise", "repair"])
@pytest.mark.parametrize("kind", KVQUEUE)
def test_held_block_in_the_free_list_is_not_handed_out(kind, policy, monkeypatch):
    pool = new_pool(kind, policy, monkeypatch)
    head = pool.free_block_queue.fake_free_list_head.next_free_block
    head.ref_cnt += 1  # a reference taken without touch(): held, still linked
    if policy == "raise":
        with raises_said(
            ValueError,
            rf"hand out block {head.block_id}, which is in the free list with ref_cnt 1",
        ):
            pool.get_new_blocks(2)
        assert linked_ids(pool)[0] == head.block_id
    else:
        assert head not in pool.get_new_blocks(2)
        assert kvqueue_vllm.pool_repairs(pool)["held_free"] == 1
        assert head.ref_cnt == 1
        assert head.block_id not in linked_ids(pool)


@pytest.mark.skipif(not LINE.has_pool_field, reason=f"vLLM {LINE.name}'s blocks name no pool")
@pytest.mark.parametrize("kind", KVQUEUE)
def test_another_pools_block_is_routed_and_checked_there(kind, monkeypatch):
    mine = new_pool(kind, "raise", monkeypatch)
    theirs = new_pool(kind, "raise", monkeypatch)
    (block,) = theirs.get_new_blocks(1)
    with raises_said(
        ValueError, rf"block {block.block_id} 2 time.*\({NUM_BLOCKS} blocks\)"
    ) as refused:
        mine.free_blocks([block, block])
    assert f"{id(theirs):#x}" in str(refused.value)  # the pool that owns it refused
    mine.free_blocks([block, mine.null_block])
    assert block.ref_cnt == 0
    assert block.block_id in linked_ids(theirs)


needs_weak = pytest.mark.skipif(
    not LINE.weak_pool, reason=f"vLLM {LINE.name}'s blocks hold their pool, not a weakref"
)


@needs_weak
@pytest.mark.parametrize("kind", ["vllm", *KVQUEUE])
def test_a_block_whose_pool_is_gone_is_skipped(kind, monkeypatch):
    """0.34's free_blocks skips a block whose (weakly named) pool is gone, however often it
    is given: the guard leaves it so, under raise too."""
    mine = new_pool(kind, None if kind == "vllm" else "raise", monkeypatch)
    gone = new_pool(kind, None if kind == "vllm" else "raise", monkeypatch)
    (orphan,) = gone.get_new_blocks(1)
    del gone
    gc.collect()
    assert orphan.pool is not None
    assert orphan.pool() is None
    (block,) = mine.get_new_blocks(1)
    mine.free_blocks([orphan, block, orphan])
    assert (orphan.ref_cnt, block.ref_cnt) == (1, 0)
    assert_pool_whole(mine)


@needs_weak
@pytest.mark.parametrize("kind", KVQUEUE)
@pytest.mark.parametrize("how", ["position", "keyword"])
@pytest.mark.parametrize("policy", ["raise", "repair"])
def test_evict_first_with_a_double_free(kind, how, policy, monkeypatch, caplog):
    """free_blocks(blocks, evict_first=True) (0.34): a block given twice is refused or
    repaired alike, and vLLM still queues the cached block at the front, as asked."""
    pool = new_pool(kind, policy, monkeypatch)
    cached, plain = pool.get_new_blocks(2)
    block_hash = kv_cache_utils.BlockHash(b"h")
    cache(pool, cached, kv_cache_utils.make_block_hash_with_group_id(block_hash, 0))
    args, kwargs = ((True,), {}) if how == "position" else ((), {"evict_first": True})
    if policy == "raise":
        with raises_said(ValueError, rf"block {cached.block_id} 2 time"):
            pool.free_blocks([cached, plain, cached], *args, **kwargs)
        assert (cached.ref_cnt, plain.ref_cnt) == (1, 1)
        pool.free_blocks([cached, plain], *args, **kwargs)
    else:
        with caplog.at_level(logging.WARNING, logger="kvqueue"):
            pool.free_blocks([cached, plain, cached], *args, **kwargs)
        assert kvqueue_vllm.pool_repairs(pool)["double_free"] == 1
    assert (cached.ref_cnt, plain.ref_cnt) == (0, 0)
    assert sorted(linked_ids(pool)[:2]) == sorted([cached.block_id, plain.block_id])
    assert_pool_whole(pool)


# -- kvqueue, on_misuse="repair": the engine keeps going, the pool stays true -----------------


@pytest.mark.parametrize("kind", KVQUEUE)
def test_repair_skips_the_second_free(kind, monkeypatch):
    pool = new_pool(kind, "repair", monkeypatch)
    blocks, second_free = double_free(pool)
    second_free()
    assert kvqueue_vllm.pool_repairs(pool)["held_free"] == 1
    assert pool.free_block_queue.repairs["linked"] == 0  # the guard saw it first
    assert blocks[0].ref_cnt == 0
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1 - 2
    assert_pool_whole(pool)


def cache(pool: Any, block: Any, block_hash: Any) -> None:
    """Cache a full block as vLLM's ``cache_full_blocks`` does: its hash (``set_block_hash``
    from 0.24, which keeps the number of tokens hashed too; the ``block_hash`` setter in
    0.23), and the pool's map from hashes to blocks, whence reuse evicts it (0.23 resets the
    hash of a block only when it finds it there)."""
    if any(name.endswith("block_hash_num_tokens") for name in LINE.block_fields):
        block.set_block_hash(block_hash)
    else:
        block.block_hash = block_hash
    pool.cached_block_hash_to_block.insert(block_hash, block)


FORMS = (
    "in-call duplicate",
    "free of a free block",
    "untouched reference",
    *(("double unpin",) if HAS_UNPIN else ()),
)


def inject(rng: random.Random, pool: Any, held: dict[int, list[Any]]) -> str | None:
    """One double free of a random form, as a buggy caller makes it; its name, or None."""
    form = rng.choice(FORMS)
    free = [b for b in pool.blocks[1:] if b.ref_cnt == 0]
    # A duplicate of a block another request holds too would release that request's
    # reference: no count can tell whose it was. The duplicates are of blocks held once.
    sole = [r for r, blocks in held.items() if any(b.ref_cnt == 1 for b in blocks)]
    if form == "in-call duplicate" and sole:
        blocks = held.pop(rng.choice(sole))
        pool.free_blocks([*blocks, rng.choice([b for b in blocks if b.ref_cnt == 1])])
    elif form == "free of a free block" and free:
        pool.free_blocks([rng.choice(free)])
    elif form == "untouched reference" and free:
        block = rng.choice(free)
        block.ref_cnt += 1  # taken without touch(): still linked
        pool.free_blocks([block])
    elif form == "double unpin" and sole:
        blocks = held.pop(rng.choice(sole))
        twice = rng.choice([b for b in blocks if b.ref_cnt == 1])
        pool.unpin_blocks([*blocks, twice], on_reuse=lambda b: None)
    else:
        return None
    return form


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kind", KVQUEUE)
def test_repair_under_load_never_hands_a_block_to_two_holders(kind, seed, monkeypatch):
    """Seeded requests allocate, hit the prefix cache and free (hashed blocks too, so frees
    go to both ends of the queue and hits take blocks out of its middle), with double frees
    of every form injected. After every operation: count = list = the blocks nobody holds,
    and each block's ``ref_cnt`` is its number of holders.
    """
    rng = random.Random(seed)
    pool = new_pool(kind, "repair", monkeypatch, num_blocks=64)
    queue = pool.free_block_queue
    held: dict[int, list[Any]] = {}  # request -> its blocks (a block once per holder)
    forms: dict[str, int] = {}
    for step in range(2000):
        action = rng.random()
        free_now = pool.get_num_free_blocks()
        if action < 0.35 and free_now:
            blocks = pool.get_new_blocks(rng.randint(1, min(free_now, 4)))
            for block in blocks:
                assert not any(block is b for bs in held.values() for b in bs), block.block_id
                if rng.random() < 0.5:  # a full block, cached: freed to the queue's tail
                    block_hash = kv_cache_utils.BlockHash(rng.randbytes(8))
                    cache(pool, block, kv_cache_utils.make_block_hash_with_group_id(block_hash, 0))
            held[step] = blocks
        elif action < 0.45:
            # A prefix hit: a block some request holds, or a free one (the middle of the queue).
            block = rng.choice(pool.blocks[1:])
            pool.touch([block])
            held[step] = [block]
        elif action < 0.8 and held:
            blocks = held.pop(rng.choice(list(held)))
            pool.free_blocks(reversed(blocks))
        else:
            form = inject(rng, pool, held)
            if form:
                forms[form] = forms.get(form, 0) + 1
        holders: dict[int, int] = {}
        for blocks in held.values():
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0), f"block {block.block_id}"
        free = truly_free(pool)
        assert pool.get_num_free_blocks() == len(free)
        assert sorted(b.block_id for b in queue.get_all_free_blocks()) == free
    repairs = kvqueue_vllm.pool_repairs(pool)
    assert sum(repairs.values()) == sum(forms.values()) > 100, (repairs, forms)
    assert set(forms) == set(FORMS)
    assert queue.repairs == dict.fromkeys(queue.repairs, 0)  # the guard saw each one first


@pytest.mark.parametrize("kind", KVQUEUE)
def test_install_can_choose_repair_without_the_environment(kind, monkeypatch):
    monkeypatch.delenv("KVQUEUE_ON_MISUSE", raising=False)
    kvqueue_vllm.install(kind, on_misuse="repair")
    pool = BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=True, hash_block_size=16)
    assert type(pool.free_block_queue).__module__ == MODULES[kind]
    _, second_free = double_free(pool)
    second_free()
    assert kvqueue_vllm.pool_repairs(pool)["held_free"] == 1
    assert_pool_whole(pool)


def test_uninstall_restores_every_method_exactly():
    kvqueue_vllm.uninstall()
    before = dict(vars(BlockPool))
    kvqueue_vllm.install("cython")
    guarded = set(kvqueue_vllm.status()["guarded"])
    assert guarded == set(LINE.pool_methods)
    assert {
        name for name, value in vars(BlockPool).items() if value is not before.get(name)
    } == guarded
    kvqueue_vllm.install("python", pool_guard=False)
    # With the guard off, 0.18-0.23's free_blocks keeps kvqueue's correction, or a block
    # it is given as many times as it holds references would be lost.
    corrected = {"free_blocks"} if LINE.counts_first else set()
    assert {
        name for name, value in vars(BlockPool).items() if value is not before.get(name)
    } == corrected
    kvqueue_vllm.install("python")
    kvqueue_vllm.uninstall()
    assert all(vars(BlockPool)[name] is value for name, value in before.items())
    assert set(vars(BlockPool)) == set(before)


@pytest.mark.parametrize("kind", KVQUEUE)
def test_a_log_handler_that_calls_back_into_the_pool(kind, monkeypatch):
    """The repair's log line is written once vLLM's method has run: a handler that frees
    and allocates (guarded calls themselves) finds the pool whole and keeps it whole."""
    pool = new_pool(kind, "repair", monkeypatch, num_blocks=16)
    held = pool.get_new_blocks(4)
    seen: list[int] = []

    class Reentrant(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(pool.get_num_free_blocks())
            if len(seen) == 1:
                (extra,) = pool.get_new_blocks(1)
                pool.free_blocks([extra, extra, held[3]])  # a second double free, nested

    handler = Reentrant()
    logger = logging.getLogger("kvqueue")
    logger.addHandler(handler)
    try:
        pool.free_blocks([held[0], held[0], held[1]])
    finally:
        logger.removeHandler(handler)
    assert seen[0] == 16 - 1 - 4 + 2  # the outer free was done when its line was written
    assert kvqueue_vllm.pool_repairs(pool)["double_free"] == 2
    assert [b.ref_cnt for b in held] == [0, 0, 1, 0]
    free = truly_free(pool)
    assert sorted(linked_ids(pool)) == free
    assert pool.get_num_free_blocks() == len(free) == 16 - 1 - 1


@pytest.mark.skipif(
    not LINE.has_pool_field,
    reason=f"vLLM {LINE.name}'s blocks name no pool: a stray block is queued as the pool's",
)
@pytest.mark.parametrize("kind", KVQUEUE)
def test_a_stray_block_vllm_would_queue_is_refused_first(kind, monkeypatch):
    """A block of no pool that free_blocks would take to 0 (vLLM counts it
    as the pool's, and kvqueue's queue refuses it) is refused before any count moves; it
    left the pool's own blocks at ref_cnt 0 in no list."""
    pool = new_pool(kind, "raise", monkeypatch)
    own = pool.get_new_blocks(3)
    stray = kv_cache_utils.KVCacheBlock(1000)
    stray.ref_cnt = 1
    with raises_said(ValueError, r"block 1000, a block of no pool.*Pool: BlockPool"):
        pool.free_blocks([*own, stray])
    assert [block.ref_cnt for block in own] == [1, 1, 1]
    assert stray.ref_cnt == 1
    pool.free_blocks(own)
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1


@pytest.mark.parametrize("kind", KVQUEUE)
def test_blocks_of_no_pool_keep_vllms_handling(kind, monkeypatch):
    """Some of vLLM's own tests free blocks they made themselves (``KVCacheBlock(id)``, no
    pool): the guard checks a pool's own blocks only, so those calls do what vLLM does."""
    pool = new_pool(kind, "raise", monkeypatch)
    stray = kv_cache_utils.KVCacheBlock(1000)
    pool.free_blocks([stray, pool.null_block])
    assert stray.ref_cnt == -1  # vLLM's decrement, unchecked, as without kvqueue
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
