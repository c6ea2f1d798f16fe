"""The environment variables kvqueue reads take a closed set of values; any other
value is refused with a message naming the variable and what it takes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from kvqueue import _env, _policy

from support.helpers import one_line

REFUSED_FLAGS = ["false", "no", "off", " 0", "0 ", "true", "yes", "on", "2", "01"]


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("0", False), ("", False)])
def test_a_flag_takes_1_0_or_nothing(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: bool
) -> None:
    monkeypatch.setenv("KVQUEUE_TEST_FLAG", value)
    assert _env.flag("KVQUEUE_TEST_FLAG") is expected
    monkeypatch.delenv("KVQUEUE_TEST_FLAG")
    assert _env.flag("KVQUEUE_TEST_FLAG", default=True) is True


@pytest.mark.parametrize("value", REFUSED_FLAGS)
def test_a_flag_refuses_anything_else_by_name(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KVQUEUE_TEST_FLAG", value)
    with pytest.raises(ValueError, match=r"^KVQUEUE_TEST_FLAG must be") as info:
        _env.flag("KVQUEUE_TEST_FLAG")
    assert str(info.value) == (
        f"KVQUEUE_TEST_FLAG must be one of '1', '0' (or unset), not {value!r}"
    )


def test_a_choice_maps_its_values(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {"a": 1, "b": 2}
    monkeypatch.setenv("KVQUEUE_TEST_CHOICE", "b")
    assert _env.choice("KVQUEUE_TEST_CHOICE", values, 0) == 2
    monkeypatch.setenv("KVQUEUE_TEST_CHOICE", "B")
    with pytest.raises(ValueError, match=r"^KVQUEUE_TEST_CHOICE must be one of 'a', 'b' "):
        _env.choice("KVQUEUE_TEST_CHOICE", values, 0)


@pytest.mark.parametrize("value", ["false", "off", " 0"])
def test_import_refuses_an_unknown_pure_value(value: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import kvqueue"],
        env={**os.environ, "KVQUEUE_PURE": value},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1
    assert f"ValueError: KVQUEUE_PURE must be one of '1', '0' (or unset), not {value!r}" in (
        done.stderr
    )


@pytest.mark.parametrize("value", ["Repair", " raise", "1"])
def test_a_queue_refuses_an_unknown_policy_value(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("KVQUEUE_ON_MISUSE", value)
    with pytest.raises(ValueError, match=r"^KVQUEUE_ON_MISUSE must be") as info:
        _policy.resolve(None)
    assert str(info.value) == (
        f"KVQUEUE_ON_MISUSE must be one of 'raise', 'repair' (or unset), not {value!r}"
    )


def test_setup_py_reading_the_file_alone_gets_the_same_words(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """setup.py loads _env.py outside the package: a refusal there imports nothing of
    kvqueue's, and says what the package's says, unwrapped."""
    spec = importlib.util.spec_from_file_location("_kvqueue_env", _env.__file__)
    assert spec is not None
    assert spec.loader is not None
    alone = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(alone)
    monkeypatch.setenv(_env.PURE, "\x01" * 20)  # wrapped in the package: escapes are wide
    with pytest.raises(ValueError, match=r"^KVQUEUE_PURE must be one of") as wrapped:
        _env.flag(_env.PURE)
    assert "\n" in str(wrapped.value)
    with pytest.raises(ValueError, match=r"^KVQUEUE_PURE must be one of") as plain:
        alone.flag(alone.PURE)
    assert type(plain.value) is ValueError
    assert str(plain.value) == one_line(wrapped.value)
