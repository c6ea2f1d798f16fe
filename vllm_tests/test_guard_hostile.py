"""The pool guard against hostile use, on vLLM's real ``BlockPool``: run with pytest in the vLLM
venv (vllm_tests/venv.sh), or in it with another line's wheel first on ``PYTHONPATH``; each test
follows the installed line (kvqueue.vllm._lines).
The same cases on a stand-in pool of every line, both twins: tests/test_pool_guard.py.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    vllm = pytest.importorskip("vllm")
    from vllm.v1.core.block_pool import BlockPool
kvqueue_vllm = pytest.importorskip("kvqueue.vllm")

from kvqueue.vllm import _pool_guard  # noqa: E402
from kvqueue.vllm._lines import find  # noqa: E402

from support.helpers import one_line, raises_said  # noqa: E402

LINE = find(vllm.__version__)
KVQUEUE = ["cython", "python"]
SCREENS = {"cython": "kvqueue.vllm._screen", "python": "kvqueue.vllm._screen_py"}
pytestmark = pytest.mark.usefixtures("kept_install")


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="kvqueue")


def new_pool(kind: str, policy: str, num_blocks: int = 8) -> Any:
    kvqueue_vllm.install(kind, on_misuse=policy)  # type: ignore[arg-type]
    return BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)


def state(pool: Any) -> tuple[Any, ...]:
    return (
        tuple(block.ref_cnt for block in pool.blocks),
        tuple(block.block_id for block in pool.free_block_queue.get_all_free_blocks()),
        pool.get_num_free_blocks(),
    )


def consistent(pool: Any) -> None:
    free = pool.free_block_queue.get_all_free_blocks()
    assert pool.get_num_free_blocks() == len(free)
    assert all(block.ref_cnt == 0 for block in free)


# -- item 2: a held block the queue will not unlink ----------------------------------------

_UNREMOVABLE = textwrap.dedent(
    """
    import faulthandler, logging, sys, warnings
    faulthandler.dump_traceback_later(60, exit=True)
    warnings.simplefilter("ignore")
    logging.getLogger("kvqueue").addHandler(logging.NullHandler())
    import kvqueue.vllm
    from vllm.v1.core.block_pool import BlockPool
    kvqueue.vllm.install(sys.argv[1], on_misuse="repair")
    for corrupt in ("pool", "prev"):
        pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
        held = pool.free_block_queue.get_all_free_blocks()[1]
        held.ref_cnt = 1
        if corrupt == "pool":
            held.pool = BlockPool(num_gpu_blocks=2, enable_caching=True, hash_block_size=16)
        else:
            held.prev_free_block = None
        try:
            pool.get_new_blocks(3)
        except RuntimeError as exc:
            assert "the queue cannot unlink it" in " ".join(str(exc).split()), exc
        else:
            raise AssertionError("a held block was handed out")
    print("returned")
    """
)


@pytest.mark.parametrize("kind", KVQUEUE)
def test_a_repair_that_cannot_unlink_returns(kind: str) -> None:
    if LINE is None or not LINE.has_pool_field:
        pytest.skip("blocks name no pool before vLLM 0.30")
    done = subprocess.run(
        [sys.executable, "-c", _UNREMOVABLE, kind],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("returned")


# -- item 3: a repair that would leave the scheduler short -------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="a held block that no live request lists (a reference held by something that lists "
    "nothing) is found only in get_new_blocks(), after the scheduler read "
    "get_num_free_blocks(): it leaves it short, and vLLM raises. Listed, the holder audit "
    "takes it out first (test_live_engine.py::test_a_repair_never_stops_the_engine)",
)
@pytest.mark.parametrize("kind", KVQUEUE)
def test_asking_for_every_free_block_after_a_repair(kind: str) -> None:
    pool = new_pool(kind, "repair")
    free = pool.free_block_queue.get_all_free_blocks()
    free[2].ref_cnt = 1  # a reference taken without touch()
    wanted = pool.get_num_free_blocks()  # what the scheduler checks first
    blocks = pool.get_new_blocks(wanted)
    assert free[2] not in blocks


# -- item 4: one walk per repairing call ------------------------------------------------------


@pytest.mark.parametrize("kind", KVQUEUE)
def test_many_negative_blocks_are_repaired_in_one_walk(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    screen = importlib.import_module(SCREENS[kind])
    walks: list[tuple[str, int]] = []
    walk = screen.first_held_free

    def counted(head: Any, n: int) -> Any:
        walks.append(("first_held_free", n))
        return walk(head, n)

    monkeypatch.setattr(screen, "first_held_free", counted)
    pool = new_pool(kind, "repair", num_blocks=2001)
    free = pool.free_block_queue.get_all_free_blocks()
    for block in free:
        block.ref_cnt = -1
    assert len(pool.get_new_blocks(2000)) == 2000
    # The passing path's walk finds a misuse (in either twin, a walk no module attribute
    # reaches), and the guard in full walks once to say which: never one walk per block.
    assert walks == [("first_held_free", 2000)]
    assert _pool_guard.pool_repairs(pool)["negative_ref"] == 2000
    consistent(pool)


# -- items 5, 8, 11 --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KVQUEUE)
def test_vllms_keywords(kind: str) -> None:
    assert LINE is not None
    pool = new_pool(kind, "repair")
    taken = pool.get_new_blocks(num_blocks=2)
    pool.touch(blocks=taken[:1])
    name = LINE.pool_methods["free_blocks"][0]
    pool.free_blocks(**{name: [taken[0], taken[0], taken[0]]})
    assert taken[0].ref_cnt == 0
    assert _pool_guard.pool_repairs(pool)["double_free"] == 1
    with pytest.raises(TypeError):
        pool.free_blocks(blocks=[taken[1]])
    assert taken[1].ref_cnt == 1
    consistent(pool)


@pytest.mark.parametrize("kind", KVQUEUE)
def test_another_pools_double_free_raises_before_anything_is_freed(kind: str) -> None:
    if LINE is None or not LINE.has_pool_field:
        pytest.skip("blocks name no pool before vLLM 0.30")
    mine = new_pool(kind, "raise")
    theirs = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    (a,) = mine.get_new_blocks(1)
    (b,) = theirs.get_new_blocks(1)
    before = state(mine), state(theirs)
    with raises_said(ValueError, f"block {b.block_id} 2 time"):
        mine.free_blocks([a, b, b])
    assert (state(mine), state(theirs)) == before


@pytest.mark.parametrize("count", [True, 1.0], ids=["bool", "float"])
@pytest.mark.parametrize("kind", KVQUEUE)
def test_a_count_of_another_type(kind: str, count: Any) -> None:
    pool = new_pool(kind, "raise")
    held = pool.free_block_queue.get_all_free_blocks()[0]
    held.ref_cnt = 1
    before = state(pool)
    with pytest.raises((ValueError, TypeError)) as info:
        pool.get_new_blocks(count)
    if type(count) is bool:
        assert "would hand out block" in one_line(info.value)
    assert state(pool) == before


@pytest.mark.parametrize("kind", KVQUEUE)
def test_a_block_listed_as_often_as_it_is_held_is_queued_once(kind: str) -> None:
    """0.18-0.23 release every occurrence before they queue those at 0 (a block held twice and
    listed twice would be queued twice); every line frees it once, and the queue is whole."""
    pool = new_pool(kind, "raise")
    first, second = pool.get_new_blocks(2)
    pool.touch([first])
    pool.free_blocks([first, second, first])
    assert first.ref_cnt == second.ref_cnt == 0
    assert pool.free_block_queue.repairs == dict.fromkeys(pool.free_block_queue.repairs, 0)
    consistent(pool)


# -- item 15: vLLM's own message, from vLLM's own repr -----------------------------------------


@pytest.mark.parametrize("kind", KVQUEUE)
def test_remove_of_an_invalid_block_says_what_vllm_says(kind: str) -> None:
    pool = new_pool(kind, "raise")
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt = 0
    with pytest.raises(RuntimeError) as info:
        pool.free_block_queue.remove(block)
    assert str(info.value) == f"remove() called on an invalid block: {block!r}"
