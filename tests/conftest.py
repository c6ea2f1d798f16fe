"""One suite, both twins: the ``queue_mod`` fixture runs a test once per twin."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


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
        pytest.param("kvqueue._queue", id="c", marks=pytest.mark.c_extension),
        pytest.param("kvqueue._queue_py", id="py"),
    ],
)
def queue_mod(request: pytest.FixtureRequest) -> ModuleType:
    """The twin under test. The compiled one is imported by name, never through
    the shim, so that a missing build fails loudly instead of testing pure twice."""
    return importlib.import_module(request.param)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--no-c-extensions"):
        return
    kept = [item for item in items if not item.get_closest_marker("c_extension")]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "c_extension: needs the compiled twin")
