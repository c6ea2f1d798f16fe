"""Fixtures that kvqueue's tests on the real vLLM share (pytest finds them here)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def kept_install() -> Iterator[None]:
    """Each test installs what it needs; what was installed before comes back after."""
    kvqueue_vllm = pytest.importorskip("kvqueue.vllm")
    was = kvqueue_vllm.status()
    yield
    kvqueue_vllm.uninstall()
    if was["implementation"] is not None:
        kvqueue_vllm.install(
            was["implementation"], on_misuse=was["on_misuse"], pool_guard=was["pool_guard"]
        )


@pytest.fixture(autouse=True)
def log_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new window of kvqueue's per-process log rate limit for each test: a test that reads a
    repair's log line must not find the lines used up by the tests before it in its process
    (which tests share a process depends on pytest-xdist's spread)."""
    monkeypatch.setattr("kvqueue._log._window_start", float("-inf"))
