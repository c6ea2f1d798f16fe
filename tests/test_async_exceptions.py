"""An exception raised asynchronously inside a call (``KeyboardInterrupt``, vLLM's
signal handlers' ``SystemExit``) leaves the queue well formed: the call done, or
undone. Injected by a trace function at every bytecode of the pure twin's code;
the compiled twin runs no bytecode inside a call, so it gets none."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

import pytest

from kvqueue import KVCacheBlock

from support.fuzz_common import well_formed


class Injected(BaseException):
    pass


def _state(queue: Any, blocks: list[Any]) -> tuple[int, list[int], list[int]]:
    """The count, the list by block id, and the ids of the blocks with no links."""
    detached = [b.block_id for b in blocks if b.prev_free_block is b.next_free_block is None]
    return queue.num_free_blocks, [b.block_id for b in queue.get_all_free_blocks()], detached


def _setup(mod: ModuleType, policy: str) -> tuple[Any, list[Any], list[Any]]:
    blocks = [KVCacheBlock(i) for i in range(8)]
    queue = mod.FreeKVCacheBlockQueue(blocks, on_misuse=policy)
    return queue, blocks, queue.popleft_n(3)


CALLS: dict[str, Callable[[Any, list[Any], list[Any]], object]] = {
    "popleft": lambda q, b, free: q.popleft(),
    "popleft_n(1)": lambda q, b, free: q.popleft_n(1),
    "popleft_n(4)": lambda q, b, free: q.popleft_n(4),
    "remove": lambda q, b, free: q.remove(b[5]),
    "append": lambda q, b, free: q.append(free[0]),
    "append_n one": lambda q, b, free: q.append_n([free[0]]),
    "append_n": lambda q, b, free: q.append_n(free),
    "prepend_n": lambda q, b, free: q.prepend_n(free),
    "append_n repaired": lambda q, b, free: q.append_n([free[0], b[4], free[0], free[1]]),
    "assign count": lambda q, b, free: setattr(q, "num_free_blocks", 2),
}


def _inject_at(target: int, code_file: str) -> tuple[Callable[..., Any], list[int]]:
    """A trace function raising Injected at the ``target``-th bytecode run in
    ``code_file``, once; and the count of bytecodes seen."""
    seen = [0]

    def local(frame: FrameType, event: str, arg: object) -> Any:
        if event == "opcode":
            seen[0] += 1
            if seen[0] == target:
                raise Injected
        return local

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        if event == "call" and frame.f_code.co_filename.endswith(code_file):
            frame.f_trace_opcodes = True
            return local
        return None

    return tracer, seen


@pytest.mark.parametrize("policy", ["raise", "repair"])
@pytest.mark.parametrize("call", CALLS)
def test_an_exception_at_any_bytecode_leaves_the_call_done_or_undone(
    queue_mod: ModuleType, call: str, policy: str
) -> None:
    queue, blocks, free = _setup(queue_mod, policy)
    before = _state(queue, blocks)
    with contextlib.suppress(ValueError):  # the misused batch under "raise"
        CALLS[call](queue, blocks, free)
    after = _state(queue, blocks)
    target = 1
    while True:
        queue, blocks, free = _setup(queue_mod, policy)
        tracer, seen = _inject_at(target, "_queue_py.py")
        sys.settrace(tracer)
        try:
            CALLS[call](queue, blocks, free)
        except (Injected, ValueError):
            pass
        finally:
            sys.settrace(None)
        if call != "assign count":  # an assigned count is not the length well_formed wants
            assert well_formed(queue) is None, (target, well_formed(queue))
        assert _state(queue, blocks) in (before, after), target
        if seen[0] < target:
            break  # ran to its end without the exception: every bytecode tried
        target += 1
