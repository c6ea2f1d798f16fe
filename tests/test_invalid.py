"""Invalid operations raise the contract's exception and change nothing."""

from __future__ import annotations

from types import ModuleType

import pytest
from invalid_ops import CASES, outcome


@pytest.mark.parametrize("name", list(CASES))
def test_invalid_operation(queue_mod: ModuleType, name: str) -> None:
    expected = CASES[name][1]
    exc_name, message, untouched = outcome(queue_mod, name)
    assert exc_name == expected.exc.__name__, message
    if expected.exact:
        assert message == expected.message
    else:
        assert message.startswith(expected.message)
    assert untouched, "the failing call changed the queue or a block"
