"""``python -m kvqueue``: the report, and its exit status, in a fresh interpreter each."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from support.helpers import one_line


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


@pytest.mark.cython
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
    assert result["problems"][0].startswith("no vLLM is installed in this environment")


@pytest.mark.parametrize("value", ["1", "auto"])
def test_without_vllm_the_report_says_so_not_that_vllm_is_stopped(value: str) -> None:
    done = run(KVQUEUE_VLLM=value)
    if "vLLM: not installed" not in done.stdout:
        pytest.skip("vLLM is installed here (vllm_tests/ covers that case)")
    assert "No module named" not in done.stdout
    assert "stops vLLM" not in done.stdout
    assert "the plugin: no vLLM is installed in this environment" in done.stdout
    # All but the first line, which names where kvqueue is installed.
    assert all(len(line) <= 100 for line in done.stdout.splitlines()[1:])


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
    from kvqueue.vllm._lines import LINES

    assert report()["accepted_vllm_lines"] == [line.release for line in LINES]


# A vLLM 0.33 of stand-ins on PYTHONPATH (tests/ too: the stand-ins are support's), and a
# plugin of another project's that replaces BlockPool.free_blocks.
_FAKE_VLLM = {
    "vllm/__init__.py": "__version__ = '0.33.0'\n",
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/v1/core/kv_cache_utils.py": (
        "from support.blocks import VllmStyleBlock as KVCacheBlock\n"
        "from support.vllm_stubs import VllmQueue as FreeKVCacheBlockQueue\n"
    ),
    "vllm/v1/core/block_pool.py": (
        "from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock\n"
        "class BlockPool:\n"
        "    def get_new_blocks(self, num_blocks): pass\n"
        "    def touch(self, blocks): pass\n"
        "    def free_blocks(self, ordered_blocks): pass\n"
        "    def unpin_blocks(self, blocks, on_reuse): pass\n"
    ),
    "vllm/v1/core/kv_cache_manager.py": (
        "from support.vllm_stubs import MANAGER_SOURCE\nexec(MANAGER_SOURCE)\n"
    ),
    "their_plugin.py": (
        "def register():\n"
        "    from vllm.v1.core import block_pool\n"
        "    def free_blocks(self, ordered_blocks): pass\n"
        "    block_pool.BlockPool.free_blocks = free_blocks\n"
    ),
    "their_plugin-0.1.dist-info/METADATA": (
        "Metadata-Version: 2.1\nName: their-plugin\nVersion: 0.1\n"
    ),
    "their_plugin-0.1.dist-info/entry_points.txt": (
        "[vllm.general_plugins]\ntheirs = their_plugin:register\n"
    ),
}


def _first_on_path(*directories: Any) -> str:
    """A ``PYTHONPATH`` with ``directories`` before the suite's own: where kvqueue is
    installed by ``PYTHONPATH`` (the aarch64 run under qemu), it must stay importable."""
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([*map(str, directories), *([inherited] if inherited else [])])


def _fake_vllm(root: Any, **replace: str) -> str:
    from support.helpers import TESTS

    for name, text in {**_FAKE_VLLM, **replace}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return _first_on_path(root, TESTS)


def _narrow(done: subprocess.CompletedProcess[str]) -> None:
    # The first line holds where kvqueue is installed: a path the machine chooses, not ours.
    assert max(map(len, done.stdout.splitlines()[1:])) <= 100, done.stdout


def test_strict_mode_refuses_a_bad_pure_value(tmp_path: Any) -> None:
    """KVQUEUE_VLLM=1 with a bad KVQUEUE_PURE: the plan stops
    vLLM, and the report does not claim a twin that import kvqueue would not load."""
    env = {"KVQUEUE_VLLM": "1", "KVQUEUE_PURE": "yes", "PYTHONPATH": _fake_vllm(tmp_path)}
    result = report(**env)
    assert result["plugin"]["action"] == "refuse"
    assert result["implementation"] is None
    [problem] = result["problems"]
    assert problem.startswith("KVQUEUE_PURE must be one of")
    done = run(**env)
    assert "the plugin stops vLLM from starting: KVQUEUE_PURE" in done.stdout
    assert "loads: cython" not in done.stdout
    _narrow(done)


def test_the_plugin_raises_where_vllms_loader_imports_kvqueue(tmp_path: Any) -> None:
    """vLLM's loader imports the entry point and logs what that raises: import kvqueue
    passes a bad KVQUEUE_PURE there, and the plugin's call, which stops vLLM, raises it."""
    loader = (
        "import importlib\n"
        "def load_plugins_by_group(group):\n"
        "    return importlib.import_module('kvqueue.vllm._plugin').plugin\n"
    )
    code = (
        "space = {'__name__': 'vllm.plugins'}\n"
        f"exec({loader!r}, space)\n"
        "plugin = space['load_plugins_by_group']('vllm.general_plugins')\n"
        "try:\n    plugin()\nexcept ValueError as exc:\n    print('refused:', exc)\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVQUEUE_", "VLLM_"))}
    clean.update(KVQUEUE_VLLM="1", KVQUEUE_PURE="yes", PYTHONPATH=_fake_vllm(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", code], env=clean, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: KVQUEUE_PURE must be one of"), done.stdout


@pytest.mark.parametrize(
    "body", ["raise RuntimeError('libcudart.so.12: cannot open')", "import sys; sys.exit(3)"]
)
def test_a_vllm_that_fails_on_import_is_a_problem(tmp_path: Any, body: str) -> None:
    """One problem line, one JSON object, no traceback."""
    env = {"KVQUEUE_VLLM": "1", "PYTHONPATH": _fake_vllm(tmp_path, **{"vllm/__init__.py": body})}
    result = report(**env)
    assert result["plugin"]["action"] == "refuse"
    assert any("importing vLLM failed" in problem for problem in result["problems"])
    done = run(**env)
    assert "Traceback" not in done.stderr + done.stdout
    assert "problem: " in done.stdout


def test_a_plugin_that_patches_a_guarded_method_first_is_in_the_plan(tmp_path: Any) -> None:
    """The plan reads what vLLM's other plugins patched before kvqueue's."""
    env = {"KVQUEUE_VLLM": "1", "PYTHONPATH": _fake_vllm(tmp_path)}
    result = report(**env)
    assert result["plugin"]["action"] == "refuse"
    assert "free_blocks is not vLLM's own" in result["plugin"]["reason"]
    assert report(**env, VLLM_PLUGINS="kvqueue")["plugin"]["action"] == "install"


def test_a_wrapped_refusal_is_one_line_in_json_word_for_word(tmp_path: Any) -> None:
    """The plugin's reason, wrapped for a traceback where kvqueue raises it, is one line in the
    JSON (and among the problems), the words the text report wraps within 100 columns."""
    env = {"KVQUEUE_VLLM": "1", "PYTHONPATH": _fake_vllm(tmp_path)}
    reason = report(**env)["plugin"]["reason"]
    assert len(reason) > 100  # wrapped where it was raised
    assert "\n" not in reason
    assert reason in report(**env)["problems"]
    done = run(**env)
    said = one_line(done.stdout)
    assert f"the plugin stops vLLM from starting: {reason} " in said
    assert f"problem: {reason}" in said
    _narrow(done)


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("KVQUEUE_AUDIT_EVERY", "sixty-four-steps-between", repr("sixty-four-steps")),
        ("KVQUEUE_PURE", "\x01" * 20, repr("\x01" * 9)),
    ],
)
def test_a_wrapped_bad_value_is_one_line_in_json(name: str, value: str, shown: str) -> None:
    """A bad value's ValueError is wrapped for a caller's traceback; the JSON says it in one
    line, as the problem, the plugin's reason, and (KVQUEUE_PURE) why no twin is named."""
    accepted = "'0', '1', '2', ..., '1024'" if name == "KVQUEUE_AUDIT_EVERY" else "'1', '0'"
    problem = f"{name} must be one of {accepted} (or unset), not {shown}"
    result = report(**{"KVQUEUE_VLLM": "1", name: value})
    assert result["problems"] == [problem]
    assert result["plugin"]["reason"] == problem
    if name == "KVQUEUE_PURE":
        assert result["why"] == f"it raises: {problem}"
    _narrow(run(**{name: value}))


def test_a_plugin_vllm_does_not_call_is_not_said_to_install(tmp_path: Any) -> None:
    """No 'installs kvqueue' before the line that says vLLM will not call
    it; VLLM_PLUGINS unset is said so; the twin is named, not 'auto'; lines fit 100 columns."""
    env = {"KVQUEUE_VLLM": "1", "PYTHONPATH": _fake_vllm(tmp_path)}
    done = run(**env, VLLM_PLUGINS="other")
    assert "the plugin installs kvqueue" not in done.stdout
    assert "the plugin is not called, so it installs nothing" in done.stdout
    _narrow(done)
    result = report(**env, VLLM_PLUGINS="kvqueue")
    assert result["plugin"]["settings"]["implementation"] in ("cython", "python")
    done = run(**env, VLLM_PLUGINS="kvqueue")
    assert "VLLM_PLUGINS='kvqueue': vLLM calls" in done.stdout
    assert "VLLM_PLUGINS unset" in run(**env).stdout
    _narrow(run(KVQUEUE_VLLM="1"))


def test_the_counters_said_are_the_metrics_module_declares(tmp_path: Any) -> None:
    """The plugin's line names each counter the metrics define, once, and no other."""
    from kvqueue.vllm import _metrics

    env = {"KVQUEUE_VLLM": "1", "PYTHONPATH": _fake_vllm(tmp_path), "VLLM_PLUGINS": "kvqueue"}
    done = run(**env)
    assert done.returncode == 0, done.stdout + done.stderr
    said = " ".join(done.stdout.split()).split("counters: ", 1)[1]
    named = re.findall(r"kvqueue_\w+_total", said)
    assert sorted(named) == sorted(f"{name}_total" for name in _metrics.COUNTERS)
    assert f"{_metrics.INFO}: active)" in said
    _narrow(done)


def _versioned_vllm(root: Any, version: str) -> str:
    """A directory holding an importable ``vllm`` of distribution version ``version``."""
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    info = root / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return _first_on_path(root)


def test_the_installed_vllm_version_and_verdict(tmp_path: Any) -> None:
    """Text and JSON say which vLLM is installed and what the table of lines says of it:
    the newest line accepted, one line newer not yet (and how to check it), one line older
    not (and why)."""
    from kvqueue.vllm._lines import LINES, OLDER

    newest = LINES[-1]
    newer = f"{newest.minor[0]}.{newest.minor[1] + 1}.0"
    older = f"{LINES[0].minor[0]}.{LINES[0].minor[1] - 1}.1"
    for version, said in (
        (older, f"not accepted: kvqueue accepts {LINES[0].name} to {newest.name} ({OLDER})"),
        (newest.release, f"accepted: line {newest.name}, proven at {newest.release}"),
        (newer, f"not accepted yet: vLLM {newer} is newer than the newest line"),
    ):
        where = _versioned_vllm(tmp_path / version, version)
        found = report(PYTHONPATH=where)["vllm"]
        assert found["version"] == version
        assert found["verdict"].startswith(said)
        text = run(PYTHONPATH=where).stdout
        assert max(map(len, text.splitlines())) <= 100
        assert f"\nvLLM {version}: {said}" in text.replace("\n  ", " ")
    assert f"make vllm-line-check VLLM={newer}" in found["verdict"]
    assert f"({newest.name}, proven at {newest.release})" in found["verdict"]


def test_the_checks_reported_are_the_registrys() -> None:
    from kvqueue.vllm import _registry

    checks = report()["checks"]
    assert checks["BlockPool.free_blocks"] == list(_registry.GUARDED["free_blocks"])
    assert checks["FreeKVCacheBlockQueue.prepend_n"] == ["held_free", "listed_free"]
    assert checks["KVCacheManager.new_step_starts"][0] == "listed_free"
    assert len(checks) == len(_registry.KINDS)


def test_a_reader_that_stops_early_gets_no_traceback() -> None:
    """``python -m kvqueue | head``: the reader gone before the report is written (``true``
    reads nothing and exits while Python starts). ``KVQUEUE_PURE`` is kept: where only the pure
    twin is installed, the fallback's warning is the one line stderr may rightly hold."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KVQUEUE_", "VLLM_")) or k == "KVQUEUE_PURE"
    }
    for flag in ("", "--json"):
        done = subprocess.run(
            f"{sys.executable} -m kvqueue {flag} | true",
            shell=True,
            env=clean,
            capture_output=True,
            text=True,
        )
        assert done.stderr == ""
