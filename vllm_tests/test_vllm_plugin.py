"""kvqueue as vLLM's general plugin, loaded by vLLM's own ``load_general_plugins()``.

Run with pytest in the vLLM venv (vllm_tests/venv.sh installs this checkout's kvqueue there
as a wheel, entry point included). Each case is a fresh interpreter, as each process vLLM
starts is: it loads the plugins three times (vLLM guards its loader with a flag; the flag is
reset to load again, as a forked child that re-runs the loader would), then builds vLLM's
real ``BlockPool`` and reports which queue it got.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest

pytest.importorskip("vllm")

from support.helpers import one_line

PROBE = textwrap.dedent(
    """
    import json, sys
    from importlib.metadata import entry_points
    import vllm.plugins
    from vllm.v1.core import block_pool

    bound = []
    for _ in range(3):
        vllm.plugins.plugins_loaded = False
        vllm.plugins.load_general_plugins()
        bound.append(id(block_pool.FreeKVCacheBlockQueue))
    pool = block_pool.BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=16)
    queue = pool.free_block_queue
    (point,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "kvqueue"]
    import kvqueue.vllm
    json.dump({
        "queue": type(queue).__module__,
        "on_misuse": getattr(queue, "on_misuse", None),
        "installed": kvqueue.vllm.status()["implementation"],
        "pool_guard": kvqueue.vllm.status()["pool_guard"],
        "rebound": len(set(bound)) != 1,
        "entry_point": point.value,
        "dist": point.dist.name,
        "kvqueue_file": kvqueue.__file__,
        "free": queue.num_free_blocks,
    }, sys.stdout)
    """
)


def probe(code: str = PROBE, **env: str) -> dict[str, Any]:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("KVQUEUE_") and k != "VLLM_PLUGINS"
    }
    clean.update(env, VLLM_TARGET_DEVICE="cpu")
    done = subprocess.run(
        [sys.executable, "-c", code], env=clean, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    assert result["entry_point"] == "kvqueue.vllm._plugin:plugin"
    assert result["dist"] == "kvqueue"
    # The installed wheel, not this checkout's src/.
    assert "site-packages" in result["kvqueue_file"]
    assert result["free"] == 5
    assert not result["rebound"]
    return result


@pytest.mark.parametrize("env", [{}, {"KVQUEUE_VLLM": ""}, {"KVQUEUE_VLLM": "0"}])
def test_off_unless_asked(env: dict[str, str]) -> None:
    result = probe(**env, KVQUEUE_ON_MISUSE="repair")
    assert result["queue"] == "vllm.v1.core.kv_cache_utils"
    assert result["installed"] is None


@pytest.mark.parametrize(
    ("value", "module"),
    [("cython", "kvqueue._queue"), ("python", "kvqueue._queue_py"), ("1", "kvqueue._queue")],
)
def test_on_when_asked(value: str, module: str) -> None:
    result = probe(KVQUEUE_VLLM=value)
    assert result["queue"] == module
    assert result["on_misuse"] == "raise"
    assert result["pool_guard"] is True


def test_pool_guard_switch() -> None:
    assert probe(KVQUEUE_VLLM="cython", KVQUEUE_POOL_GUARD="0")["pool_guard"] is False
    assert probe(KVQUEUE_VLLM="cython", KVQUEUE_POOL_GUARD="1")["pool_guard"] is True


def test_policy_from_the_environment() -> None:
    assert probe(KVQUEUE_VLLM="python", KVQUEUE_ON_MISUSE="repair")["on_misuse"] == "repair"


@pytest.mark.parametrize(
    ("allowed", "module"), [("other", None), ("other,kvqueue", "kvqueue._queue")]
)
def test_vllm_plugins_is_respected(allowed: str, module: str | None) -> None:
    result = probe(KVQUEUE_VLLM="cython", VLLM_PLUGINS=allowed)
    assert result["queue"] == (module or "vllm.v1.core.kv_cache_utils")


@pytest.mark.parametrize(
    ("name", "value"), [("KVQUEUE_VLLM", "yes"), ("KVQUEUE_ON_MISUSE", "bogus")]
)
def test_bad_value_stops_vllm_with_one_line(name: str, value: str) -> None:
    """vLLM's loader calls the plugin bare: its process ends with kvqueue's line, exit status 1,
    and no traceback."""
    env = dict(os.environ, KVQUEUE_VLLM="1", VLLM_TARGET_DEVICE="cpu")
    env[name] = value
    code = "import vllm.plugins; vllm.plugins.load_general_plugins(); print('vLLM went on')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 1
    assert "vLLM went on" not in done.stdout
    assert "Traceback" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith(f"kvqueue: {name} must be one of "), done.stderr[-2000:]
    assert len(last) <= 100


# A stand-in for another project's guard (vllm-ascend, Dynamo): it patches vLLM's pool
# method in place, before or after vLLM loads the plugins, and counts its calls.
FOREIGN = textwrap.dedent(
    """
    import json, os, sys
    import vllm.plugins
    from vllm.v1.core import block_pool

    def theirs_patch():
        mine = block_pool.BlockPool.free_blocks
        def free_blocks(self, blocks):
            calls.append(1)
            return mine(self, blocks)
        free_blocks.__module__ = "their_project.patches"
        block_pool.BlockPool.free_blocks = free_blocks

    calls = []
    when = os.environ["_KVQUEUE_TEST_PATCH"]
    if when == "before":
        theirs_patch()
    try:
        vllm.plugins.load_general_plugins()
    except Exception as exc:
        json.dump({"error": f"{type(exc).__name__}: {exc}"}, sys.stdout)
        raise SystemExit(0)
    if when == "after":
        theirs_patch()
    import kvqueue.vllm
    pool = block_pool.BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=16)
    (block,) = pool.get_new_blocks(1)
    try:
        pool.free_blocks([block, block])
        refused = None
    except ValueError as exc:
        refused = str(exc)
    pool.free_blocks([block])
    json.dump({"refused": refused, "calls": len(calls), "ref_cnt": block.ref_cnt,
               "status": kvqueue.vllm.status(), "free": pool.get_num_free_blocks()}, sys.stdout)
    kvqueue.vllm.uninstall()
    assert block_pool.BlockPool.free_blocks.__module__ == (
        "their_project.patches" if when != "none" else "vllm.v1.core.block_pool")
    """
)


def foreign(when: str, **env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVQUEUE_")}
    clean.update(env, KVQUEUE_VLLM="cython", _KVQUEUE_TEST_PATCH=when, VLLM_TARGET_DEVICE="cpu")
    done = subprocess.run(
        [sys.executable, "-c", FOREIGN], env=clean, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_another_projects_patch_before_the_plugin_is_refused_by_name() -> None:
    result = foreign("before")
    error = one_line(result["error"])
    assert error.startswith("VLLMLayoutError: vllm.v1.core.block_pool.BlockPool.free_blocks ")
    assert "is not vLLM's own: their_project.patches.theirs_patch" in error
    assert "KVQUEUE_WRAP_FOREIGN=1" in error


def test_another_projects_patch_wrapped_when_asked() -> None:
    result = foreign("before", KVQUEUE_WRAP_FOREIGN="1")
    assert "double free" in one_line(result["refused"])
    assert result["calls"] == 1  # theirs ran once, on the valid free, after kvqueue's check
    assert result["ref_cnt"] == 0
    assert result["free"] == 5


def test_another_projects_patch_after_the_plugin_wraps_the_guard() -> None:
    result = foreign("after")
    assert "double free" in one_line(result["refused"])
    assert result["calls"] == 2  # theirs ran first, both times, and called kvqueue's guard
    assert result["status"]["pool_guard"] is True
    assert result["ref_cnt"] == 0
    assert result["free"] == 5


def test_no_patch_refuses_nothing() -> None:
    result = foreign("none")
    assert "double free" in one_line(result["refused"])
    assert result["calls"] == 0


VLLM_LOG = textwrap.dedent(
    """
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    configure_logging(LoggingConfig())  # as vLLM's engine processes do at start
    import vllm.plugins
    vllm.plugins.load_general_plugins()
    from vllm.v1.core.block_pool import BlockPool
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block, block])
    """
)


def test_kvqueue_lines_in_vllms_own_log() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQUEUE_")}
    env.update(KVQUEUE_VLLM="cython", KVQUEUE_ON_MISUSE="repair", VLLM_TARGET_DEVICE="cpu")
    done = subprocess.run(
        [sys.executable, "-c", VLLM_LOG], env=env, capture_output=True, text=True, check=True
    )
    vllm_format = r"\(MainProcess pid=\d+\) {} \d\d-\d\d \d\d:\d\d:\d\d \[{}:\d+\] "
    prefix = re.compile(vllm_format.format(r"\w+", r"[^\]]+"))
    # vLLM's format puts its prefix before each line of a record, kvqueue's lines at most 100
    # columns, the lines that continue one indented: each record one line again.
    lines: list[str] = []
    for line in (done.stdout + done.stderr).splitlines():
        if "kvqueue" not in line and "BlockPool" not in line:
            continue
        found = prefix.match(line)
        said = line[found.end() :] if found else line
        assert len(said) <= 100, line
        if found and said.startswith("  ") and lines:
            lines[-1] += " " + said.strip()
        else:
            lines.append(line)
    assert re.fullmatch(
        vllm_format.format("INFO", r"kvqueue/_plugin\.py")
        + r"kvqueue \S+ active on vLLM \d+\.\d+: vLLM's free block queue "
        r"is kvqueue's cython twin, pool guard on \(.*free_blocks.*\), holder audit on, "
        r"on_misuse=repair",
        lines[0],
    ), lines
    assert re.fullmatch(
        vllm_format.format("WARNING", r"kvqueue/_log\.py")
        + r"BlockPool\.free_blocks\(\) repaired a double free \(double_free #1 on this pool\): "
        r"block 1: .* called from <string>:10 in <module>",
        lines[1],
    ), lines


def diagnose(*, plain: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVQUEUE_", "VLLM_PLUGINS"))}
    clean.update(env, VLLM_TARGET_DEVICE="cpu")
    return subprocess.run(
        [sys.executable, "-m", "kvqueue", *([] if plain else ["--json"])],
        env=clean,
        capture_output=True,
        text=True,
    )


def test_python_m_kvqueue_with_the_plugin_on() -> None:
    done = diagnose(KVQUEUE_VLLM="python", KVQUEUE_ON_MISUSE="repair")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["vllm"]["plugin_loaded_by_vllm"] is True
    assert report["plugin"]["action"] == "install"
    assert report["plugin"]["settings"] == {
        "implementation": "python",
        "on_misuse": "repair",
        "pool_guard": True,
        "wrap_foreign": False,
        "audit_every": 0,
    }


def test_python_m_kvqueue_says_what_is_checked_where() -> None:
    done = diagnose(plain=True, KVQUEUE_VLLM="1")
    assert done.returncode == 0, done.stdout + done.stderr
    said = re.findall(r"^    (\w+\.\w+) +(\S.*)$", done.stdout, re.M)
    assert said == [
        ("BlockPool.get_new_blocks", "held_free, negative_ref, listed_free"),
        ("BlockPool.touch", "negative_ref, listed_free"),
        ("BlockPool.free_blocks", "double_free, held_free, listed_free, under_counted"),
        ("BlockPool.unpin_blocks", "double_free, held_free"),
        ("FreeKVCacheBlockQueue.append", "held_free, listed_free"),
        ("FreeKVCacheBlockQueue.append_n", "held_free, listed_free"),
        ("FreeKVCacheBlockQueue.prepend_n", "held_free, listed_free"),
        (
            "KVCacheManager.new_step_starts",
            "listed_free, listed_twice, two_managers, under_counted",
        ),
    ]
    unguarded = diagnose(plain=True, KVQUEUE_VLLM="1", KVQUEUE_POOL_GUARD="0")
    assert "checked where" not in unguarded.stdout


def test_python_m_kvqueue_says_when_vllm_will_not_call_it() -> None:
    done = diagnose(KVQUEUE_VLLM="1", VLLM_PLUGINS="other")
    assert done.returncode == 1
    (problem,) = json.loads(done.stdout)["problems"]
    assert problem == (
        "KVQUEUE_VLLM=1 but vLLM will not call kvqueue's plugin "
        "(VLLM_PLUGINS does not name kvqueue)"
    )
