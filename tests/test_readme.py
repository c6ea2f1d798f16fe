"""The README's Python examples run as written and print what they say they print; the README
and CONTRIBUTING fit in 100 columns, and say what they name before they use it."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

import kvqueue

from support.helpers import load_script

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

    items = re.findall(r"^- `(KVQUEUE_\w+)`: (.*?)\n(?=- |\n)", README.read_text(), re.M | re.S)
    assert {name: " ".join(text.split()) for name, text in items} == dict(_env.MEANINGS)


def test_the_table_of_lines_is_the_codes() -> None:
    if not README.exists():
        pytest.skip("the suite runs outside the source tree (no README.md beside tests/)")
    from kvqueue.vllm._lines import LINES

    rows = re.findall(r"^\| (0\.\d+) \| (0\.\d+\.\d+) \|", README.read_text(), re.MULTILINE)
    assert rows == [(line.name, line.release) for line in LINES]


def test_a_newcomer_is_told_what_the_demo_needs() -> None:
    """The demo's interpreter, disk, time, venv, other lines and torch (the command for
    PyTorch's CPU index as the demo's refusal gives it); which releases are accepted; and the
    README stays short."""
    if not README.exists():
        pytest.skip("the suite runs outside the source tree (no README.md beside tests/)")
    text = README.read_text()
    # A budget, not the README's length: about four screens, what a newcomer reads through.
    assert len(text.splitlines()) <= 240
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
        f"export KVQUEUE_TORCH_INDEX={load_script('vllm_tests/torch_source.py').CPU_INDEX} ",
        "export KVQUEUE_TORCH_CUDA=1 ",
        "rc and dev builds",
    ):
        assert needed in flat, needed


@pytest.mark.parametrize("name", ["README.md", "CONTRIBUTING.md"])
def test_every_line_fits_in_100_columns(name: str) -> None:
    path = README.parent / name
    if not path.exists():
        pytest.skip(f"the suite runs outside the source tree (no {name} beside tests/)")
    text = path.read_text()
    wide = [(n, len(line)) for n, line in enumerate(text.splitlines(), 1) if len(line) > 100]
    assert wide == []


def test_terms_are_said_before_they_are_used() -> None:
    """A term of kvqueue's is first met where the README says what it is (in italics)."""
    if not README.exists():
        pytest.skip("the suite runs outside the source tree (no README.md beside tests/)")
    text = README.read_text().lower()
    for term in ("line", "three ways", "holder audit", "twin"):
        first = re.search(rf"(?<!\w){term}s?(?!\w)", text)
        assert first is not None, term
        assert text[first.start() - 1] == "*", (term, text[first.start() - 80 : first.end()])


def test_the_performance_summary_is_the_benchmarks() -> None:
    """The README's ratios are the range of bench/README.md's microbenchmark table, per twin:
    measured once, said twice, held together here."""
    bench = README.parent / "bench" / "README.md"
    if not bench.is_file():
        pytest.skip("the suite runs outside the source tree (no bench/ beside tests/)")
    section = bench.read_text().split("## Microbenchmark", 1)[1]
    table = section.split("\n\n| case |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if " ns |" in line]
    ratios: dict[str, list[float]] = {"compiled": [], "pure": []}
    for cells in rows:
        for twin, columns in (("compiled", (2, 5)), ("pure", (3, 6))):
            ratios[twin] += [float(cells[c].split()[0]) for c in columns]
    said = " ".join(README.read_text().split("## Performance", 1)[1].split("##", 1)[0].split())
    compiled, pure = (f"{min(found):.2f}-{max(found):.2f}" for found in ratios.values())
    assert f"{compiled} of the time of vLLM's own on the compiled twin" in said
    assert f"{pure} on the pure one" in said
