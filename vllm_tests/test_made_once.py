"""The cache's extracted trees are made once when pytest's workers ask at the same time."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import sdist


def test_made_once_by_one_of_many_callers(tmp_path: Path) -> None:
    fills = []
    seen = []

    def fill(staging: Path) -> None:
        fills.append(staging)
        time.sleep(0.2)  # long enough that every other caller arrives while it fills
        (staging / "made").write_text("yes", encoding="utf-8")

    def ask() -> None:
        root = sdist.made_once(tmp_path / "tree", "recipe\n", fill)
        seen.append((root / "made").read_text(encoding="utf-8"))

    callers = [threading.Thread(target=ask) for _ in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(fills) == 1
    assert seen == ["yes"] * 4
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tree-")] == []


def test_made_again_for_another_recipe(tmp_path: Path) -> None:
    def fill(text: str):
        return lambda staging: (staging / "made").write_text(text, encoding="utf-8")

    root = sdist.made_once(tmp_path / "tree", "one\n", fill("one"))
    assert sdist.made_once(tmp_path / "tree", "one\n", fill("other")) == root
    assert (root / "made").read_text(encoding="utf-8") == "one"
    sdist.made_once(tmp_path / "tree", "two\n", fill("two"))
    assert (root / "made").read_text(encoding="utf-8") == "two"
