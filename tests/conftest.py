"""One suite, both twins: the ``queue_mod`` fixture runs a test once per twin."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

import pytest

from kvqueue import _log

from support.twins import TWINS, twin


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-c-extensions",
        action="store_true",
        default=False,
        help="Run the tests of the pure-Python twin only",
    )


@pytest.fixture(
    scope="session",
    params=[
        pytest.param(key, id=key, marks=[pytest.mark.c_extension] if key == "c" else [])
        for key in TWINS
    ],
)
def queue_mod(request: pytest.FixtureRequest) -> ModuleType:
    """The twin under test."""
    return twin(request.param)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("kvqueue.vllm._screen", id="c", marks=pytest.mark.c_extension),
        pytest.param("kvqueue.vllm._screen_py", id="py"),
    ],
)
def screen(request: pytest.FixtureRequest) -> ModuleType:
    """The pool guard's screens under test, both twins."""
    return importlib.import_module(request.param)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--no-c-extensions"):
        return
    kept = [item for item in items if not item.get_closest_marker("c_extension")]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "c_extension: needs the compiled twin")


@pytest.fixture
def repair_log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The test's records, with the per-process rate limit's window just
    reopened: earlier tests of the process may have spent its budget."""
    monkeypatch.setattr(_log, "_window_start", float("-inf"))
    caplog.set_level(logging.WARNING, logger="kvqueue")
    return caplog
