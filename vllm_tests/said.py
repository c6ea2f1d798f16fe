"""kvqueue's messages read as one line, as the suite reads them (tests/support/helpers.py, which
is not on this directory's path): kvqueue wraps its messages to 100 columns at spaces that move
with their values (a pool's address, a caller's path), and puts the pool and the caller on a
line of their own."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest


def one_line(message: object) -> str:
    """``message`` with each line break and the indent after it read as the space it replaced."""
    return re.sub(r"\n *", " ", str(message))


@contextlib.contextmanager
def raises_said(
    expected: type[BaseException], pattern: str
) -> Iterator[pytest.ExceptionInfo[BaseException]]:
    """``pytest.raises(expected, match=pattern)`` on the message read as :func:`one_line`."""
    with pytest.raises(expected) as raised:
        yield raised
    said = one_line(raised.value)
    assert re.search(pattern, said), f"{pattern!r} not in {said!r}"
