"""One suite, both twins: the ``implementation`` fixture, and every fixture read from it
(``queue_mod``, ``screen``), runs a test once per twin."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import pytest

from kvqueue import _log

from support.twins import NAMES, Facade, facade


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-cython",
        action="store_true",
        default=False,
        help="Run the tests of the python twin only",
    )


@pytest.fixture(
    scope="session",
    params=[
        pytest.param(name, id=name, marks=[pytest.mark.cython] if name == "cython" else [])
        for name in NAMES
    ],
)
def implementation(request: pytest.FixtureRequest) -> Facade:
    """The twin under test: every fixture of a twin is read from it."""
    return facade(request.param)


@pytest.fixture(scope="session")
def queue_mod(implementation: Facade) -> ModuleType:
    """The twin's queue module."""
    return implementation.queue


@pytest.fixture(scope="session")
def screen(implementation: Facade) -> ModuleType:
    """The twin's screens of the pool guard."""
    return implementation.screen


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--no-cython"):
        return
    kept = [item for item in items if not item.get_closest_marker("cython")]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cython: needs the cython twin")


@pytest.fixture
def repair_log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The test's records, with the per-process rate limit's window just
    reopened: earlier tests of the process may have spent its budget."""
    monkeypatch.setattr(_log, "_window_start", float("-inf"))
    caplog.set_level(logging.WARNING, logger="kvqueue")
    return caplog
