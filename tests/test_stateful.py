"""Hypothesis drives both twins through the same calls and shrinks any
divergence from the list model to a minimal program."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from helpers import check_queue
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvqueue import KVCacheBlock

POOL = 12


def machine_for(queue_mod: ModuleType) -> type[RuleBasedStateMachine]:
    class QueueMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = [KVCacheBlock(i) for i in range(POOL)]
            self.queue: Any = queue_mod.FreeKVCacheBlockQueue(self.blocks)
            self.free = list(self.blocks)
            self.used: list[Any] = []

        @rule(n=st.integers(0, POOL))
        def popleft_n(self, n: int) -> None:
            if n > len(self.free):
                with pytest.raises(AssertionError):
                    self.queue.popleft_n(n)
                return
            popped = self.queue.popleft_n(n)
            assert all(a is b for a, b in zip(popped, self.free[:n], strict=True))
            del self.free[:n]
            self.used.extend(popped)

        @precondition(lambda self: bool(self.free))
        @rule(data=st.data())
        def remove(self, data: st.DataObject) -> None:
            block = data.draw(st.sampled_from(self.free))
            self.queue.remove(block)
            self.free.remove(block)
            self.used.append(block)

        @precondition(lambda self: bool(self.used))
        @rule(data=st.data(), front=st.booleans())
        def give_back(self, data: st.DataObject, front: bool) -> None:
            batch = data.draw(st.lists(st.sampled_from(self.used), min_size=1, unique_by=id))
            for block in batch:
                self.used.remove(block)
            if front:
                self.queue.prepend_n(batch)
                self.free[:0] = batch
            else:
                self.queue.append_n(batch)
                self.free.extend(batch)

        @precondition(lambda self: bool(self.used))
        @rule(data=st.data())
        def duplicate_batch_is_refused(self, data: st.DataObject) -> None:
            block = data.draw(st.sampled_from(self.used))
            with pytest.raises(ValueError, match="more than once"):
                self.queue.append_n([block, block])

        @invariant()
        def matches_the_model(self) -> None:
            check_queue(self.queue, self.free, self.blocks)

    return QueueMachine


def test_state_machine(queue_mod: ModuleType) -> None:
    machine = machine_for(queue_mod)
    machine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    machine.TestCase().runTest()
