"""The twins under test, named once, as kvqueue names them (``kvqueue.IMPLEMENTATION``:
``"cython"``, ``"python"``): the suite's fixtures, the fuzz programs and the tests that put
the two side by side all take them from here."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from kvqueue import _twin
from kvqueue.vllm import _pool_guard

NAMES = ("cython", "python")


@dataclass(frozen=True)
class Facade:
    """One twin as the suite uses it, paired as kvqueue.vllm pairs it: ``name``, the module
    of its queue and the pool guard's screens of the same twin."""

    name: str
    queue: ModuleType
    screen: ModuleType


def facade(name: str) -> Facade:
    """The twin ``name`` names (``_twin.named``): the compiled one by its own name, so that a
    build without it fails instead of testing the pure one twice."""
    chosen = _twin.named(name)
    queue = importlib.import_module(chosen.queue.__module__)
    return Facade(chosen.name, queue, _pool_guard.screens(chosen.name))


def twin(name: str) -> ModuleType:
    """The queue module of the twin ``name`` names."""
    return facade(name).queue


def of(queue_mod: ModuleType) -> Facade:
    """The twin whose queue module ``queue_mod`` is (the compiled one is not imported for
    the pure one's: a build without it runs the pure one's tests)."""
    found = facade("python")
    if found.queue is not queue_mod:
        found = facade("cython")
    assert found.queue is queue_mod, queue_mod
    return found


def both() -> tuple[ModuleType, ModuleType]:
    """The compiled twin and the pure one, for side-by-side comparisons."""
    return twin("cython"), twin("python")
