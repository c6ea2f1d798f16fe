"""kvqueue under ``vllm serve`` on the CPU (API server and engine core each in its own process,
the stub model of vllm_tests/live/): completions served, and kvqueue's counters on ``/metrics``.

Run as test_live_engine.py is (``make vllm-tests``); a server takes 20-80 s to start, and each
test starts its own. Apart from test_live_engine.py so that pytest-xdist's ``--dist loadfile``
runs the two files side by side.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytest

# Importing vLLM imports torch, whose import-time DeprecationWarnings are not ours to fail on
# (the repository's pytest settings turn warnings into errors).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("vllm")
pytest.importorskip("kvqueue.vllm")

# vllm_tests/ is on sys.path: pytest inserts a test file's directory (no __init__.py here).
from live import INJECT, JOURNAL, driver, model

# -- vllm serve ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        result: dict[str, Any] = json.load(response)
    return result


def test_vllm_serve_answers_completions_with_kvqueue(tmp_path: Path) -> None:
    """``vllm serve`` on loopback with the stub executor and KVQUEUE_VLLM=1; a few requests."""
    model_dir = driver.model.write(tmp_path / "model")
    journal = tmp_path / "serve.journal"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVQUEUE_", "_KVQUEUE"))}
    env.update(
        KVQUEUE_VLLM="1",
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(driver.HERE.parent),
        **{JOURNAL: str(journal)},
    )
    command = [
        sys.executable, "-m", "live.serve", "serve", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "stub",
        *driver.serve_args(),
    ]  # fmt: skip
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vllm serve did not come up in 180 s"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        prompts = driver.prompts(0, 4)
        for prompt in prompts:
            body = {"model": "stub", "prompt": prompt, "max_tokens": 8, "ignore_eos": True,
                    "return_token_ids": True}  # fmt: skip
            choice = _post(base + "/v1/completions", body)["choices"][0]
            assert choice["finish_reason"] == "length"
            assert choice["token_ids"] == model.completion(prompt, 8)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    events = [json.loads(line) for line in journal.read_text().splitlines()]
    (start,) = [e for e in events if e["event"] == "started"]
    assert start["queue"] == "kvqueue._queue.FreeKVCacheBlockQueue"
    assert not [e for e in events if e["event"] in ("violation", "died")]


# --- kvqueue's counters on vllm serve's /metrics ---------------------------------------------

#: Makes the vLLM every process imports say 0.99.0, a line kvqueue does not accept.
UNACCEPTED = """\
import importlib.machinery, sys

class _Renamed:
    def find_spec(self, name, path, target=None):
        if name != "vllm":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            module.__version__ = "0.99.0"
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Renamed())
"""


def _scrape(base: str) -> dict[str, float]:
    """``/metrics`` as {sample with its labels: value}, comments aside."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _serve_and_scrape(
    tmp_path: Path, settings: dict[str, str], *options: str, site: Path | None = None
) -> tuple[dict[str, float], dict[str, float], list[dict[str, Any]]]:
    """``vllm serve`` with kvqueue's ``settings``; /metrics before and after 8 requests
    (two rounds of 4: the second hits the first's prefixes), and the engine core's journal."""
    model_dir = driver.model.write(tmp_path / "model")
    journal = tmp_path / "serve.journal"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVQUEUE_", "_KVQUEUE"))}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(settings)
    path = [str(driver.HERE.parent)] + ([str(site)] if site else [])
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(path),
        **{JOURNAL: str(journal)},
    )
    command = [
        sys.executable, "-m", "live.serve", "serve", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "stub",
        *driver.serve_args(), *options,
    ]  # fmt: skip
    log_path = tmp_path / "serve.log"
    log = log_path.open("w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "vllm serve did not come up in 240 s"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        first = _scrape(base)
        for round_ in range(2):
            for prompt in driver.prompts(round_, 4):
                body = {"model": "stub", "prompt": prompt, "max_tokens": 8, "ignore_eos": True,
                        "return_token_ids": True}  # fmt: skip
                choice = _post(base + "/v1/completions", body)["choices"][0]
                assert choice["token_ids"] == model.completion(prompt, 8)
        # vLLM's own counters reach its front end once a step's stats come back.
        time.sleep(2)
        last = _scrape(base)
        print("\n".join(f"{k} {v}" for k, v in last.items() if k.startswith("kvqueue_")))
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    events = [json.loads(line) for line in journal.read_text().splitlines()]
    return first, last, events


def _kvqueue(scrape: dict[str, float], prefix: str) -> dict[str, float]:
    return {k: v for k, v in scrape.items() if k.startswith(prefix)}


#: vLLM's counters that a fixed workload fixes.
DETERMINISTIC = ("vllm:prompt_tokens_total{", "vllm:generation_tokens_total{",
                 "vllm:request_success_total{")  # fmt: skip


@pytest.fixture(scope="module")
def plain_serve(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """/metrics of the same run without kvqueue, per ``--api-server-count`` (vLLM's
    multiprocess collection lists no ``_created`` samples: each mode is its own baseline)."""
    done: dict[tuple[str, ...], dict[str, float]] = {}

    def get(*options: str) -> dict[str, float]:
        if options not in done:
            done[options] = _serve_and_scrape(tmp_path_factory.mktemp("plain"), {}, *options)[1]
        return done[options]

    return get


@pytest.mark.parametrize("api_servers", [1, 2])
def test_vllm_serve_metrics_count_exactly_the_double_frees_injected(
    tmp_path: Path, api_servers: int, plain_serve: Any
) -> None:
    """Under ``repair``, forms A, B and D once each: ``kvqueue_guard_repairs_total`` moves by
    exactly the injections (D's at the free that would have released its holder's reference:
    the holder audit finds nothing), at 0 before; every vLLM metric is still there, same
    values."""
    settings = {"KVQUEUE_VLLM": "1", "KVQUEUE_ON_MISUSE": "repair", INJECT: "ABD"}
    options = ("--api-server-count", str(api_servers))
    first, last, events = _serve_and_scrape(tmp_path, settings, *options)
    injected = [e for e in events if e["event"] == "injected"]
    assert sorted(e["form"] for e in injected) == ["A", "B", "D"]
    assert not [e for e in events if e["event"] == "died"]
    # D's release was left out at its free: the pool is exact at every check.
    violations = [e for e in events if e["event"] == "violation"]
    assert not [v for v in violations if v["found"]], violations
    labels = 'engine="0",kind="double_free",method="free_blocks",model_name="stub"'
    repaired = f"kvqueue_guard_repairs_total{{{labels}}}"
    released = 'engine="0",kind="listed_free",method="free_blocks",model_name="stub"'
    found = 'engine="0",kind="listed_free",model_name="stub"'
    before = _kvqueue(first, "kvqueue_guard_") | _kvqueue(first, "kvqueue_audit_")
    assert before
    assert set(before.values()) == {0.0}
    after = _kvqueue(last, "kvqueue_guard_") | _kvqueue(last, "kvqueue_audit_")
    assert after.keys() == before.keys()
    assert after[repaired] == 2
    assert after[f"kvqueue_guard_repairs_total{{{released}}}"] == 1
    assert after[f"kvqueue_audit_findings_total{{{found}}}"] == 0
    assert sum(after.values()) == 3
    # The queue's own repairs, at 0 from the first scrape: the guard left the queue none to make.
    queue = _kvqueue(first, "kvqueue_queue_repairs_") | _kvqueue(last, "kvqueue_queue_repairs_")
    assert 'kind="linked",method="append_n"' in " ".join(queue)
    assert set(queue.values()) == {0.0}
    (info,) = _kvqueue(last, "kvqueue_info{").items()
    assert info[1] == 1.0
    assert 'audit_every="0"' in info[0]
    assert 'state="active"' in info[0]
    assert 'on_misuse="repair"' in info[0]
    assert 'engine="0"' in info[0]
    assert 'model_name="stub"' in info[0]
    # vLLM's own metrics: every name listed without kvqueue is listed, deterministic ones equal.
    plain = plain_serve(*options)
    names = {sample.split("{")[0] for sample in plain if sample.startswith("vllm:")}
    assert names <= {sample.split("{")[0] for sample in last}
    for sample, value in plain.items():
        if sample.startswith(DETERMINISTIC):
            assert last[sample] == value, sample


def test_vllm_serve_metrics_count_per_engine_under_data_parallel_2(tmp_path: Path) -> None:
    """``--data-parallel-size 2`` (vLLM's CPU path runs it here): each engine core's counters
    and info under its own ``engine`` label, each moved by its own engine's injection."""
    settings = {"KVQUEUE_VLLM": "1", "KVQUEUE_ON_MISUSE": "repair", INJECT: "A"}
    _, last, events = _serve_and_scrape(tmp_path, settings, "--data-parallel-size", "2")
    injected = [e for e in events if e["event"] == "injected"]
    assert len({e["pid"] for e in injected}) == len(injected) == 2
    for engine in ("0", "1"):
        labels = f'engine="{engine}",kind="double_free",method="free_blocks",model_name="stub"'
        assert (
            _kvqueue(last, "kvqueue_guard_repairs_total{")[
                f"kvqueue_guard_repairs_total{{{labels}}}"
            ]
            == 1.0
        )
        (info,) = [k for k in _kvqueue(last, "kvqueue_info{") if f'engine="{engine}"' in k]
        assert 'state="active"' in info


def test_vllm_serve_metrics_say_kvqueue_is_not_active_on_a_line_it_does_not_accept(
    tmp_path: Path,
) -> None:
    """``KVQUEUE_VLLM=auto`` on a vLLM that says 0.99.0: kvqueue_info says not active, why."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(UNACCEPTED)
    first, _, events = _serve_and_scrape(tmp_path, {"KVQUEUE_VLLM": "auto"}, site=tmp_path / "site")
    (start,) = [e for e in events if e["event"] == "started"]
    assert start["status"]["pool_guard"] is False
    (info,) = _kvqueue(first, "kvqueue_info{").items()
    assert info[1] == 1.0
    assert 'state="not active"' in info[0]
    assert "0.99.0" in info[0]
    assert not _kvqueue(first, "kvqueue_guard_")
