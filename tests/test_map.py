"""CONTRIBUTING's map of the house names every module of src/kvqueue/, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
SRC = ROOT / "src" / "kvqueue"


def test_every_module_has_a_row_and_every_row_a_module() -> None:
    if not (CONTRIBUTING.exists() and SRC.is_dir()):
        pytest.skip("the suite runs outside the source tree (no CONTRIBUTING.md, no src/)")
    modules = {
        path.relative_to(SRC).as_posix()
        for path in SRC.rglob("*")
        if path.suffix in (".py", ".pyx", ".h") and "__pycache__" not in path.parts
    }
    section = CONTRIBUTING.read_text().partition("## The house")[2].partition("\n## ")[0]
    rows = re.findall(r"^\| (`[^|]+) \| [^|]+ \|$", section, re.MULTILINE)
    named = {name for row in rows for name in re.findall(r"`([^`]+)`", row)}
    assert sorted(modules - named) == [], "modules without a row in CONTRIBUTING.md"
    assert sorted(named - modules) == [], "rows of CONTRIBUTING.md naming no module"
