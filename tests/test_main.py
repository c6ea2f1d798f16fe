"""``python -m kvqueue``: the report, and its exit status, in a fresh interpreter each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVQUEUE_", "VLLM_"))}
    clean.update(env)
    return subprocess.run(
        [sys.executable, "-m", "kvqueue", *args], env=clean, capture_output=True, text=True
    )


def report(**env: str) -> dict[str, Any]:
    done = run("--json", **env)
    result: dict[str, Any] = json.loads(done.stdout)
    assert done.returncode == (1 if result["problems"] else 0)
    return result


def test_plain_report_names_every_variable() -> None:
    done = run()
    assert done.returncode == 0, done.stderr
    import kvqueue

    assert done.stdout.startswith(f"kvqueue {kvqueue.__version__} (")
    for name in ("KVQUEUE_PURE", "KVQUEUE_ON_MISUSE", "KVQUEUE_VLLM", "KVQUEUE_POOL_GUARD"):
        assert f"  {name} unset " in done.stdout


def test_help() -> None:
    done = run("--help")
    assert done.returncode == 0
    assert "--json" in done.stdout
    assert "python -m kvqueue: what kvqueue does in this environment" in done.stdout
    assert "``" not in done.stdout  # the docstring's reST markup


@pytest.mark.c_extension
def test_says_which_twin_and_why() -> None:
    assert report()["implementation"] == "cython"
    pure = report(KVQUEUE_PURE="1")
    assert (pure["implementation"], pure["why"]) == ("python", "KVQUEUE_PURE=1")


def test_a_bad_policy_is_a_problem() -> None:
    result = report(KVQUEUE_ON_MISUSE="fix")
    assert result["problems"] == [
        "KVQUEUE_ON_MISUSE must be one of 'raise', 'repair' (or unset), not 'fix'"
    ]


def test_asking_for_vllm_without_it_is_a_problem() -> None:
    result = report(KVQUEUE_VLLM="1")
    if result["vllm"]["installed"]:
        pytest.skip("vLLM is installed here (vllm_tests/ covers that case)")
    assert result["plugin"]["action"] == "refuse"
    assert result["problems"] == [result["plugin"]["reason"]]
    assert "vllm" in result["problems"][0]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KVQUEUE_PURE", "yes"),
        ("KVQUEUE_PURE", "maybe"),
        ("KVQUEUE_POOL_GUARD", "off"),
        ("KVQUEUE_WRAP_FOREIGN", "yes"),
        ("KVQUEUE_VLLM", "maybe"),
        ("KVQUEUE_VLLM", "\udcff"),
    ],
)
def test_every_bad_value_is_one_problem_and_no_traceback(name: str, value: str) -> None:
    """Whether or not vLLM is installed, every variable is checked."""
    for args in ((), ("--json",)):
        done = run(*args, PYTHONIOENCODING="utf-8:strict", **{name: value})
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr
    result = report(**{name: value})
    [problem] = result["problems"]
    assert problem.startswith(f"{name} must be one of")


def test_a_bad_policy_is_reported_once_when_the_plugin_is_on() -> None:
    result = report(KVQUEUE_ON_MISUSE="fix", KVQUEUE_VLLM="1")
    assert len(result["problems"]) == 1
    assert result["plugin"]["action"] == "refuse"


def test_the_accepted_lines_are_the_tables() -> None:
    from kvqueue._vllm_lines import LINES

    assert report()["accepted_vllm_lines"] == [line.release for line in LINES]


def _fake_vllm(root: Any, version: str) -> str:
    """A directory holding an importable ``vllm`` of distribution version ``version``."""
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    info = root / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return str(root)


def test_the_installed_vllm_version_and_verdict(tmp_path: Any) -> None:
    """Text and JSON say which vLLM is installed and what the table of lines says of it:
    the newest line accepted, one line newer not yet (and how to check it)."""
    from kvqueue._vllm_lines import LINES

    newest = LINES[-1]
    newer = f"{newest.minor[0]}.{newest.minor[1] + 1}.0"
    for version, said in (
        (newest.release, f"accepted: line {newest.name}, proven at {newest.release}"),
        (newer, f"not accepted yet: vLLM {newer} is newer than the newest line"),
    ):
        where = _fake_vllm(tmp_path / version, version)
        found = report(PYTHONPATH=where)["vllm"]
        assert found["version"] == version
        assert found["verdict"].startswith(said)
        text = run(PYTHONPATH=where).stdout
        assert f"\nvLLM {version}: {said}" in text
    assert f"make vllm-line-check VLLM={newer}" in found["verdict"]
    assert f"({newest.name}, proven at {newest.release})" in found["verdict"]
