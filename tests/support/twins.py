"""The twins under test, named once: the suite's fixture, the fuzz programs and
the tests that put the two side by side all take them from here."""

from __future__ import annotations

import importlib
from types import ModuleType

TWINS = {"c": "kvqueue._queue", "py": "kvqueue._queue_py"}


def twin(key: str) -> ModuleType:
    """The twin ``key`` names; the compiled one by its own name, so that a build
    without it fails instead of testing the pure one twice."""
    return importlib.import_module(TWINS[key])


def both() -> tuple[ModuleType, ModuleType]:
    """The compiled twin and the pure one, for side-by-side comparisons."""
    return twin("c"), twin("py")
