"""Hypothesis drives both twins through the same calls and shrinks any
divergence from the list oracle to a minimal program."""

from __future__ import annotations

from types import ModuleType

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvqueue import KVCacheBlock

from support.mirror import Mirror
from support.oracle import Oracle

POOL = 12


def machine_for(queue_mod: ModuleType) -> type[RuleBasedStateMachine]:
    class QueueMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            blocks = [KVCacheBlock(i) for i in range(POOL)]
            self.mirror = Mirror(queue_mod, Oracle(KVCacheBlock), blocks)

        @rule(n=st.integers(0, POOL))
        def popleft_n(self, n: int) -> None:
            self.mirror.call("popleft_n", n)

        @precondition(lambda self: bool(self.mirror.free))
        @rule(data=st.data())
        def remove(self, data: st.DataObject) -> None:
            self.mirror.call("remove", data.draw(st.sampled_from(tuple(self.mirror.free))))

        @precondition(lambda self: bool(self.mirror.used))
        @rule(data=st.data(), front=st.booleans())
        def give_back(self, data: st.DataObject, front: bool) -> None:
            batch = data.draw(st.lists(st.sampled_from(self.mirror.used), min_size=1, unique_by=id))
            self.mirror.call("prepend_n" if front else "append_n", batch)

        @precondition(lambda self: bool(self.mirror.used))
        @rule(data=st.data())
        def duplicate_batch_is_refused(self, data: st.DataObject) -> None:
            block = data.draw(st.sampled_from(self.mirror.used))
            self.mirror.call("append_n", [block, block], raises=ValueError, match="more than once")

        @invariant()
        def matches_the_oracle(self) -> None:
            self.mirror.check()

    return QueueMachine


def test_state_machine(queue_mod: ModuleType) -> None:
    machine = machine_for(queue_mod)
    machine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    machine.TestCase().runTest()
