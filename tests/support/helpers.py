"""State checks shared by the behavioural, model and fuzz tests; kvqueue's messages read as one
line; the runner of tests/isolated."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from itertools import pairwise
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

import pytest

from kvqueue import KVCacheBlock
from kvqueue._render import one_line as one_line

Snapshot = tuple[int, tuple[tuple[int, int, int], ...]]


def snapshot(queue: Any, blocks: Iterable[Any]) -> Snapshot:
    """The whole observable state: the count, and every block's two links by identity.

    The sentinels are included, so any write anywhere shows up.
    """
    everything = [queue.fake_free_list_head, queue.fake_free_list_tail, *blocks]
    return queue.num_free_blocks, tuple(
        (id(b), id(b.prev_free_block), id(b.next_free_block)) for b in everything
    )


def check_queue(queue: Any, expected: Sequence[Any], all_blocks: Iterable[Any]) -> None:
    """Assert that ``queue`` holds exactly ``expected``, in order, and is well formed.

    Checks the count, both directions of every link, the sentinels, the
    iteration APIs, and that every block not in the queue is fully detached.
    """
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    assert queue.num_free_blocks == len(expected) == len(queue)
    assert head.block_id == tail.block_id == -1
    assert head.prev_free_block is None
    assert tail.next_free_block is None
    chain = [head, *expected, tail]
    for left, right in pairwise(chain):
        assert left.next_free_block is right, (left, right)
        assert right.prev_free_block is left, (left, right)
    listed = queue.get_all_free_blocks()
    assert all(a is b for a, b in zip(listed, expected, strict=True))
    assert all(a is b for a, b in zip(queue.iter_blocks_after(None), expected, strict=True))
    assert sum(1 for _ in queue) == len(expected)
    members = {id(b) for b in expected}
    for block in all_blocks:
        if id(block) not in members:
            assert block.prev_free_block is None, block
            assert block.next_free_block is None, block


@contextlib.contextmanager
def raises_said(
    expected: type[BaseException] | tuple[type[BaseException], ...], pattern: str
) -> Iterator[pytest.ExceptionInfo[BaseException]]:
    """``pytest.raises(expected, match=pattern)`` on the message read as :func:`one_line`."""
    with pytest.raises(expected) as raised:
        yield raised
    said = one_line(raised.value)
    assert re.search(pattern, said), f"{pattern!r} not in {said!r}"


TESTS = Path(__file__).resolve().parent.parent


def bound_queue(queue_mod: ModuleType, n: int, on_misuse: str) -> tuple[Any, list[Any]]:
    """A queue of ``queue_mod``'s twin bound to a pool of its own, and its ``n`` blocks
    (``block_id`` 0 to ``n - 1``), all free."""
    pool = object()
    blocks = [KVCacheBlock(i, pool=pool) for i in range(n)]
    return queue_mod.FreeKVCacheBlockQueue(blocks, on_misuse=on_misuse), blocks


def link(queue: Any, method: str, blocks: list[Any]) -> None:
    """``blocks`` linked by the queue's ``method`` (``append``: one call a block)."""
    if method == "append":
        for block in blocks:
            queue.append(block)
    else:
        getattr(queue, method)(blocks)


def load_script(relative: str) -> ModuleType:
    """Import one of the checkout's scripts (``examples/demo.py``) by path; skip where the
    suite runs on an installed wheel, away from the checkout."""
    path = TESTS.parent / relative
    if not path.is_file():
        pytest.skip(f"the suite runs outside the source tree (no {relative})")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def isolated_cases(namespace: dict[str, Any]) -> tuple[str, ...]:
    """The cases of a program of tests/isolated (its ``globals()``): the public functions it
    defines, in order, each run as ``case(twin_module_name)``."""
    return tuple(
        name
        for name, value in namespace.items()
        if type(value) is FunctionType
        and not name.startswith("_")
        and value.__module__ == namespace["__name__"]
    )


def run_case(namespace: dict[str, Any]) -> None:
    """A program of tests/isolated (its ``globals()``) run as ``python -m isolated.NAME CASE
    TWIN``: its case ``CASE`` on the twin module ``TWIN``."""
    case, twin = sys.argv[1:]
    namespace[case](twin)


def run_isolated(
    program: str, *args: str, flags: Sequence[str] = (), timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -X dev -W error FLAGS -m isolated.PROGRAM ARGS`` in a fresh interpreter that
    imports the suite's modules as pytest does (tests/ first on ``PYTHONPATH``): what may
    crash or hang is run where it cannot take the suite with it."""
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", *flags, "-m", f"isolated.{program}", *args],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
