"""The README's Python examples run as written and print what they say they print."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

import kvqueue

README = Path(__file__).resolve().parent.parent / "README.md"
EXAMPLES = (
    re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL) if README.exists() else []
)


def test_readme_has_examples() -> None:
    if not README.exists():
        pytest.skip("the suite runs outside the source tree (no README.md beside tests/)")
    assert any("print(" in example for example in EXAMPLES)


@pytest.mark.parametrize("example", [e for e in EXAMPLES if "print(" in e])
def test_readme_example_prints_what_it_says(example: str) -> None:
    # The printed lines follow the code as comments: "# <expected line>".
    code, _, tail = example.partition("\n# ")
    expected = ("# " + tail).replace("# ", "").strip()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    expected = expected.replace("cython", kvqueue.IMPLEMENTATION, 1)
    assert out.getvalue().strip() == expected


def test_the_settings_table_says_what_each_variable_does() -> None:
    """Each variable's meaning is written once, in kvqueue._env; the README quotes it."""
    if not README.exists():
        pytest.skip("the suite runs outside the source tree (no README.md beside tests/)")
    from kvqueue import _env

    rows = re.findall(r"^\| `(KVQUEUE_\w+)` \| (.*) \|$", README.read_text(), re.MULTILINE)
    assert dict(rows) == dict(_env.MEANINGS)


def test_the_table_of_lines_is_the_codes() -> None:
    if not README.exists():
        pytest.skip("the suite runs outside the source tree (no README.md beside tests/)")
    from kvqueue.vllm._lines import LINES

    rows = re.findall(r"^\| (0\.\d+) \| (0\.\d+\.\d+) \|", README.read_text(), re.MULTILINE)
    assert rows == [(line.name, line.release) for line in LINES]


def test_a_newcomer_is_told_what_the_demo_needs() -> None:
    """The demo's interpreter, disk, time, venv, other lines and
    torch; which releases are accepted; and the README stays short."""
    if not README.exists():
        pytest.skip("the suite runs outside the source tree (no README.md beside tests/)")
    text = README.read_text()
    assert len(text.splitlines()) <= 180
    flat = " ".join(text.split())
    pins = dict(
        line.split("=", 1)
        for line in (README.parent / "vllm_tests" / "vllm.env").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    for needed in (
        "`python3.11`",
        "4 GB",
        f"~/.cache/kvqueue/vllm-{pins['VLLM_VERSION']}-venv",
        "`VLLM=0.31.0`",
        f"`torch=={pins['TORCH_VERSION']}+cpu`",
        "`KVQUEUE_TORCH_INDEX`",
        "`KVQUEUE_TORCH_CUDA=1`",
        "rc and dev builds",
    ):
        assert needed in flat, needed
