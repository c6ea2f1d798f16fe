"""The import shim, checked in fresh interpreters: which twin loads, and when."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import kvqueue; print(kvqueue.IMPLEMENTATION, kvqueue.FreeKVCacheBlockQueue.__module__)"

# Refuses the compiled module, as an interpreter without the built extension would.
NO_EXTENSION = (
    """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "kvqueue._queue":
            raise ImportError("no compiled twin here")
sys.meta_path.insert(0, Refuse())
"""
    + PROBE
)


def run(code: str, **env: str) -> str:
    return run_both(code, **env)[0]


def run_both(code: str, **env: str) -> tuple[str, str]:
    """The stripped stdout and stderr of ``code`` in a fresh interpreter."""
    environ = {k: v for k, v in os.environ.items() if k != "KVQUEUE_PURE"}
    environ.update(env)
    done = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )
    return done.stdout.strip(), done.stderr.strip()


@pytest.mark.cython
def test_compiled_twin_is_preferred() -> None:
    assert run(PROBE) == "cython kvqueue._queue"


@pytest.mark.cython
@pytest.mark.parametrize("value", ["", "0"])
def test_pure_flag_off_values(value: str) -> None:
    assert run(PROBE, KVQUEUE_PURE=value) == "cython kvqueue._queue"


def test_pure_twin_on_request() -> None:
    assert run(PROBE, KVQUEUE_PURE="1") == "python kvqueue._queue_py"


def test_missing_extension_falls_back_with_a_warning() -> None:
    out, err = run_both(NO_EXTENSION)
    assert out == "python kvqueue._queue_py"
    assert (
        "RuntimeWarning: kvqueue: the compiled queue is not available (no compiled twin here)"
        in err
    )
    assert "Set KVQUEUE_PURE=1" in err


def test_chosen_pure_twin_is_silent() -> None:
    assert run_both(NO_EXTENSION, KVQUEUE_PURE="1") == ("python kvqueue._queue_py", "")


# What importing the compiled twin does on a free-threaded CPython under -W error.
GIL_WARNING_AS_ERROR = NO_EXTENSION.replace(
    'raise ImportError("no compiled twin here")',
    'raise RuntimeWarning("The global interpreter lock (GIL) has been enabled")',
)


def test_gil_warning_as_error_falls_back() -> None:
    assert run(GIL_WARNING_AS_ERROR) == "python kvqueue._queue_py"


# What PyPy or GraalPy would report; the shim must not even try the extension.
OTHER_INTERPRETER = (
    """
import sys, types
sys.implementation = types.SimpleNamespace(**{**vars(sys.implementation), "name": "pypy"})
"""
    + PROBE
)


def test_other_interpreters_get_the_pure_twin() -> None:
    assert run(OTHER_INTERPRETER) == "python kvqueue._queue_py"


def test_public_api() -> None:
    out = run(
        "import kvqueue; print(sorted(kvqueue.__all__)); "
        "print(kvqueue.KVCacheBlock is __import__('kvqueue._block').KVCacheBlock)"
    )
    assert out.splitlines() == [
        "['FreeKVCacheBlockQueue', 'IMPLEMENTATION', 'KVCacheBlock', '__version__']",
        "True",
    ]


def test_both_twins_share_the_block_class(queue_mod: object) -> None:
    import kvqueue

    queue = queue_mod.FreeKVCacheBlockQueue([])  # type: ignore[attr-defined]
    assert queue.block_type is kvqueue.KVCacheBlock
