"""vllm_tests/torch_source.py, the vLLM venv's torch check: pip's listing, no download."""

from __future__ import annotations

import subprocess
from types import ModuleType
from typing import Any

import pytest

from support.helpers import load_script


@pytest.fixture
def torch_source() -> ModuleType:
    return load_script("vllm_tests/torch_source.py")


@pytest.mark.parametrize(
    ("listed", "cuda", "status"),
    [
        ("2.14.0, 2.13.0+cpu, 2.13.0", "", 0),
        ("2.14.0, 2.13.0", "", 3),
        ("2.14.0, 2.13.0", "1", 0),
        ("2.14.0", "1", 3),
    ],
)
def test_the_check_downloads_nothing_and_says_what_to_set(
    torch_source: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
    listed: str,
    cuda: str,
    status: int,
) -> None:
    """Only pip's listing is read (a dry run of the install downloaded
    the 526 MB wheel); a refusal says both choices' sizes and the command for each, within 100
    columns."""
    commands: list[list[str]] = []

    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        out = f"torch (2.14.0)\nAvailable versions: {listed}\n"
        return subprocess.CompletedProcess(command, 0, out, "")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("KVQUEUE_TORCH_CUDA", cuda)
    monkeypatch.setattr("sys.argv", ["torch_source.py", "2.13.0"])
    assert torch_source.main() == status
    assert [command[3:5] for command in commands] == [["index", "versions"]]
    said = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 100 for line in said)
    if status == 3:
        *why, cpu, cuda = said
        assert "GB" in " ".join(why)
        assert cpu.startswith("  export KVQUEUE_TORCH_INDEX=https://download.pytorch.org/whl/cpu ")
        assert cuda.startswith("  export KVQUEUE_TORCH_CUDA=1 ")
    else:
        assert len(said) == 1
