"""kvqueue in a live vLLM engine: ``vllm.LLM`` / ``AsyncLLM`` on the CPU, engine core in its own
process, a stub model with a real KV cache on the CPU (vllm_tests/live/).

Run with pytest in the vLLM venv (``make vllm-tests``); for an older line, with that line's
Python code first on ``PYTHONPATH`` (``PYTHONPATH=$(python vllm_tests/lines.py 0.31.0)``):
the engine cores the tests start import the vLLM this process imports. Each run is a fresh
driver process (``live.driver.run``) whose only kvqueue settings are ``KVQUEUE_VLLM`` and
``KVQUEUE_ON_MISUSE``, as a user's; what the engine core saw comes back in its journal
(``live.scheduler``). Every completion is checked against the stub model's own answer
(``live.model.completion``), which the engine gives only if no two requests held one KV block.
A run takes 30-60 s, so each is made once and shared by the tests that read it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

# Importing vLLM imports torch, whose import-time DeprecationWarnings are not ours to fail on
# (the repository's pytest settings turn warnings into errors).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("vllm")
pytest.importorskip("kvqueue.vllm")

import vllm

# vllm_tests/ is on sys.path: pytest inserts a test file's directory (no __init__.py here).
from live import INJECT, JOURNAL, driver, model

from kvqueue import _vllm_lines

TWINS = {"cython": "kvqueue._queue", "python": "kvqueue._queue_py"}
#: KVQUEUE_VLLM for each twin: "1" is what a user sets, and picks the compiled twin.
SETTING = {"cython": "1", "python": "python"}
VLLM_POOL = os.path.join("vllm", "v1", "core", "block_pool.py")
#: The line of the vLLM under test: what its pool does with a double free differs.
LINE = _vllm_lines.find(vllm.__version__)
#: What a right engine answers, round by round (the driver's default workload).
RIGHT = driver.completions(3, 20, 24)
#: Form C needs a pool that fills up (a round's peak is about 120 blocks).
FULL_POOL = ("--blocks", "96")


class Runs:
    """Driver runs made on first use and kept for the session."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.done: dict[tuple[Any, ...], driver.Run] = {}

    def get(
        self,
        kvqueue: str | None,
        policy: str | None = None,
        inject: str | None = None,
        **kwargs: Any,
    ) -> driver.Run:
        key = (kvqueue, policy, inject, repr(sorted(kwargs.items(), key=str)))
        if key not in self.done:
            if "extra_env" in kwargs:
                kwargs["extra_env"] = dict(kwargs["extra_env"])
            self.done[key] = driver.run(self.work, kvqueue, policy, inject, **kwargs)
        return self.done[key]


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("live"))


def started(run: driver.Run) -> dict[str, Any]:
    (event,) = run.events("started")
    return event


def assert_served(run: driver.Run) -> None:
    """Every request served, and served right."""
    assert run.result["error"] is None, run.output[-3000:]
    assert run.completed == 60
    assert run.events("died") == []
    assert run.result["outputs"] == RIGHT


def wrong(run: driver.Run) -> int:
    """The completions the user got that the model would not have given."""
    return sum(
        got != want
        # strict=False: a dead engine leaves rounds unserved
        for got_round, want_round in zip(run.result["outputs"], RIGHT, strict=False)
        for got, want in zip(got_round, want_round, strict=True)
    )


# -- the engine as users start it ----------------------------------------------------------


def test_engine_core_is_its_own_spawned_process(runs: Runs) -> None:
    run = runs.get(None)
    assert_served(run)
    report = run.result["report"]
    assert report["pid"] == started(run)["pid"]  # the scheduler and the executor: one process
    assert report["pid"] != run.result["pid"]
    assert report["start_method"] == "spawn"
    assert started(run)["queue"] == "vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue"
    # The vLLM this process imported (an older line first on PYTHONPATH) is the engine's.
    assert started(run)["vllm"] == vllm.__version__


def test_the_models_answer_moves_with_every_token() -> None:
    """A KV slot that holds another request's token gives another answer."""
    prompt = driver.prompts(0, 1)[0]
    answer = model.next_token(prompt)
    for position in (0, len(prompt) // 2, len(prompt) - 1):
        changed = [*prompt]
        changed[position] = (changed[position] + 1) % model.VOCAB
        assert model.next_token(changed) != answer, position


def _step(worker: Any, new: list[Any], cached: list[tuple[str, int, int]]) -> list[list[int]]:
    """One scheduler step for the stub worker: new requests (id, prompt, blocks, computed),
    cached ones (id, computed, scheduled); its sampled tokens."""
    scheduled = {r.req_id: len(r.prompt_token_ids) - r.num_computed_tokens for r in new}
    scheduled.update({request_id: count for request_id, _, count in cached})
    output = worker.execute_model(
        SimpleNamespace(
            finished_req_ids=set(),
            scheduled_new_reqs=new,
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[c[0] for c in cached],
                new_block_ids=[None] * len(cached),
                resumed_req_ids=set(),
                num_computed_tokens=[c[1] for c in cached],
            ),
            num_scheduled_tokens=scheduled,
        )
    )
    return list(output.sampled_token_ids)


def test_the_stub_computes_from_its_kv_cache() -> None:
    """The stub worker's tokens come from what its cache holds: a prefix hit reads the blocks
    another request wrote, and a block written by a second holder changes the first's next
    token."""
    with warnings.catch_warnings():  # vLLM's executor modules import more of torch
        warnings.simplefilter("ignore", DeprecationWarning)
        from live.executor import StubWorker

    block = driver.BLOCK_SIZE
    config = SimpleNamespace(
        get_total_num_kv_heads=lambda: 4,
        get_head_size=lambda: 64,
        hf_text_config=SimpleNamespace(num_hidden_layers=2),
    )
    worker = StubWorker(
        SimpleNamespace(model_config=config, cache_config=SimpleNamespace(block_size=block))
    )
    worker.initialize_from_config([SimpleNamespace(num_blocks=8)])
    prompt = driver.prompts(0, 1)[0][: 2 * block + 3]  # two full blocks, three tokens more

    def new(request_id: str, tokens: list[int], blocks: list[int], computed: int) -> Any:
        return SimpleNamespace(
            req_id=request_id, prompt_token_ids=tokens, block_ids=(blocks,),
            num_computed_tokens=computed,
        )  # fmt: skip

    assert _step(worker, [new("a", prompt, [1, 2, 3], 0)], []) == [[model.next_token(prompt)]]
    # "b" hits a's two full blocks: it writes only its own tokens, in its own block 4.
    other = [*prompt[: 2 * block], 7, 8, 9, 10]
    assert _step(worker, [new("b", other, [1, 2, 4], 2 * block)], []) == [[model.next_token(other)]]
    # "c" is handed block 2 while "a" holds it (a double free's outcome) and writes it.
    intruder = driver.prompts(1, 1)[0][:block]
    _step(worker, [new("c", intruder, [2], 0)], [])
    tokens = [*prompt, model.next_token(prompt)]
    (got,) = _step(worker, [], [("a", len(prompt), 1)])
    assert got != [model.next_token(tokens)]
    assert got == [model.next_token(prompt[:block] + intruder + tokens[2 * block :])]


@pytest.mark.parametrize("twin", TWINS)
def test_the_engine_cores_pool_holds_kvqueues_queue(runs: Runs, twin: str) -> None:
    run = runs.get(SETTING[twin])
    assert_served(run)
    assert run.env == {"KVQUEUE_VLLM": SETTING[twin], JOURNAL: run.env[JOURNAL]}
    assert started(run)["queue"] == f"{TWINS[twin]}.FreeKVCacheBlockQueue"
    assert started(run)["installed"] == twin
    assert run.result["report"]["installed"] == twin


def vllms_own(methods: dict[str, str]) -> set[str]:
    """The pool methods whose code is still vLLM's (block_pool.py)."""
    return {name for name, path in methods.items() if path.endswith(VLLM_POOL)}


@pytest.mark.parametrize("twin", TWINS)
def test_the_engine_cores_pool_is_guarded(runs: Runs, twin: str) -> None:
    start = started(runs.get(SETTING[twin]))
    assert start["status"]["implementation"] == twin
    assert start["status"]["pool_guard"] is True
    assert start["status"]["on_misuse"] in (None, "raise")  # None: the environment's, unset
    assert start["on_misuse"] == "raise"
    assert vllms_own(start["methods"]) == set()
    assert set(start["methods"]) == set(start["status"]["guarded"])


def test_the_guard_can_be_turned_off(runs: Runs) -> None:
    run = runs.get("1", extra_env=(("KVQUEUE_POOL_GUARD", "0"),))
    assert_served(run)
    assert started(run)["status"]["pool_guard"] is False
    assert vllms_own(started(run)["methods"]) == set(started(run)["methods"])


def test_every_contender_serves_the_models_answers(runs: Runs) -> None:
    """No double free: vLLM alone and each twin give each request the model's completion."""
    for setting in (None, *SETTING.values()):
        run = runs.get(setting)
        assert_served(run)
        assert run.events("violation") == [], setting


def test_async_llm_asked_to_fork_spawns_and_serves_the_same(runs: Runs) -> None:
    """AsyncLLM with kvqueue; the fork asked for is overridden by vLLM's CPU platform."""
    run = runs.get(
        "1", args=("--api", "async"), extra_env=(("VLLM_WORKER_MULTIPROC_METHOD", "fork"),)
    )
    assert_served(run)
    assert run.result["report"]["start_method"] == "spawn"
    assert started(run)["queue"] == "kvqueue._queue.FreeKVCacheBlockQueue"


# -- injected double frees ------------------------------------------------------------------


@pytest.mark.parametrize("form", ["A", "B"])
def test_vllm_alone_serves_wrong_completions_or_dies(runs: Runs, form: str) -> None:
    """vLLM's own pool takes the block's ref_cnt to -1 and keeps it linked as free; the next
    round's prefix hit takes it (ref_cnt 0) while it stays in the free list, so it is handed
    out again while held: a completion comes out wrong, with no error, unless the engine core
    dies first at get_new_blocks' bare assert (the block popped at ref_cnt -1).

    vLLM 0.23 decrements every occurrence before it queues any, and queues a block only at 0:
    given twice (A), the block is at -1 and in no free list, lost to the pool, and nobody
    else is handed it."""
    run = runs.get(None, inject=form)
    (injected,) = run.events("injected")
    damage = run.events("violation")
    died = run.events("died")
    assert damage, run.output[-3000:]
    block = injected["block"]
    assert f"block {block}: ref_cnt -1, 0 holders" in damage[0]["found"]
    if form == "A" and LINE.counts_first:
        assert f"block {block}: held by none, not in the free list (lost)" in damage[0]["found"]
        assert_served(run)
        return
    assert wrong(run) or died, run.output[-3000:]
    if died:  # seen: AssertionError at block_pool.py's get_new_blocks
        assert died[0]["raised_at"].startswith(("block_pool.py:", "kv_cache_utils.py:"))
        assert run.result["error"] is not None


@pytest.mark.parametrize("twin", TWINS)
def test_repair_serves_every_request_and_keeps_the_pool_exact(runs: Runs, twin: str) -> None:
    run = runs.get(SETTING[twin], "repair", "AB", inject_count=2)
    assert_served(run)
    assert started(run)["on_misuse"] == "repair"
    injected = run.events("injected")
    assert sorted(event["form"] for event in injected) == ["A", "A", "B", "B"]
    assert run.events("violation") == [], run.events("violation")[:3]
    repaired = [e for e in run.events("log") if "repaired a double free" in e["message"]]
    assert len(repaired) >= 1
    assert sum(run.events("repairs")[-1]["counters"].values()) == len(injected)


@pytest.mark.parametrize(("form", "twin"), [("A", "cython"), ("B", "python")])
def test_raise_stops_at_the_faulty_free(runs: Runs, form: str, twin: str) -> None:
    run = runs.get(SETTING[twin], "raise", form)
    (injected,) = run.events("injected")
    (refused,) = run.events("refused")
    assert "double free" in refused["message"]
    assert re.search(rf"\b{injected['block']}\b", refused["message"])
    assert "BlockPool.free_blocks()" in refused["message"]
    assert refused["pool_after"] == []  # raised before anything changed
    assert run.events("violation") == []
    assert run.result["error"] is not None  # the engine core stopped on it, loudly
    assert "double free" in run.output
    assert wrong(run) == 0


@pytest.mark.parametrize("twin", TWINS)
def test_a_repair_never_stops_the_engine(runs: Runs, twin: str) -> None:
    """Issue 24 item 3: a held block in the free list of a full pool, which counts it free.
    Its holder lists it, so the holder audit takes it out where the next step starts, before
    the scheduler counts it: the engine serves every request, each one right. The block was
    planted without a free, so only a full read of the listings finds it (every step here;
    by default every KVQUEUE_AUDIT_EVERY steps, else get_new_blocks' guard when it meets it)."""
    run = runs.get(
        SETTING[twin], "repair", "C", args=FULL_POOL, extra_env={"KVQUEUE_AUDIT_EVERY": "1"}
    )
    (injected,) = run.events("injected")
    assert injected["ref_cnt"] == 1
    assert injected["free_blocks"] == 1
    assert run.events("violation")[0]["found"] == [
        f"block {injected['block']}: held by 1 and in the free list"
    ]
    assert_served(run)
    assert run.events("violation")[-1]["found"] == []  # exact again once repaired
    assert run.events("repairs")[-1]["counters"]["listed_free"] == 1


# -- form D: a free that releases a reference its holder still lists ------------------------


def test_vllm_alone_gives_a_listed_block_to_another_request(runs: Runs) -> None:
    run = runs.get(None, inject="D")
    (injected,) = run.events("injected")
    block = injected["block"]
    found = [f for v in run.events("violation") for f in v["found"]]
    assert any(f.startswith(f"block {block}: ") for f in found), run.output[-3000:]
    assert wrong(run) or run.events("died"), run.output[-3000:]


def test_raise_stops_where_the_next_step_starts(runs: Runs) -> None:
    run = runs.get(SETTING["cython"], "raise", "D")
    (injected,) = run.events("injected")
    (died,) = run.events("died")
    assert died["type"] == "HolderAuditError"
    assert f"block {injected['block']} is in the free list" in died["message"]
    assert f"request '{injected['request']}'" in died["message"]
    assert "kvqueue/_rules.py" in died["raised_at"] or "_rules.py" in died["raised_at"]
    assert wrong(run) == 0  # stopped before serving anything wrong
    assert run.result["error"] is not None


@pytest.mark.parametrize("twin", TWINS)
def test_repair_keeps_the_block_with_its_holder(runs: Runs, twin: str) -> None:
    run = runs.get(SETTING[twin], "repair", "D")
    assert_served(run)
    assert run.events("repairs")[-1]["counters"]["listed_free"] == 1
    logged = [e for e in run.events("log") if "holder audit repaired" in e["message"]]
    assert len(logged) == 1


def test_vllm_alone_hands_out_a_held_block(runs: Runs) -> None:
    """Form C without kvqueue: vLLM pops the held block and dies at its bare assert, or links
    it twice when its holder frees it."""
    run = runs.get(None, inject="C", args=FULL_POOL)
    (injected,) = run.events("injected")
    assert run.events("died") or wrong(run), run.output[-3000:]
    assert any(
        f"block {injected['block']}" in found
        for v in run.events("violation")
        for found in v["found"]
    )


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


def test_kvqueue_speaks_in_the_engine_cores_own_log(runs: Runs) -> None:
    """The active line and the repairs, in vLLM's format, from the engine core's process."""
    run = runs.get(SETTING["cython"], "repair", "AB", inject_count=2)
    prefix = r"\(EngineCore pid=\d+\) {} \d\d-\d\d \d\d:\d\d:\d\d \[{}:\d+\] "
    # kvqueue's module as vLLM's format names it: kvqueue/_vllm_plugin.py, or its name alone.
    module = r"(?:kvqueue/)?\w+\.py"
    active = prefix.format("INFO", module) + (
        r"kvqueue \S+ active on vLLM \S+: vLLM's free block queue is kvqueue's cython twin, "
        r"pool guard on \(.*\), holder audit on, on_misuse=repair"
    )
    repaired = prefix.format("WARNING", module) + (
        r"BlockPool\.(free_blocks|get_new_blocks|touch)\(\) repaired a double free"
    )
    lines = run.output.splitlines()
    assert any(re.search(active, line) for line in lines), run.output[-3000:]
    assert any(re.search(repaired, line) for line in lines), run.output[-3000:]


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
    exactly the injections (D's where the holder audit repaired it, which its findings count
    too), at 0 before; every vLLM metric is still there, same values."""
    settings = {"KVQUEUE_VLLM": "1", "KVQUEUE_ON_MISUSE": "repair", INJECT: "ABD"}
    options = ("--api-server-count", str(api_servers))
    first, last, events = _serve_and_scrape(tmp_path, settings, *options)
    injected = [e for e in events if e["event"] == "injected"]
    assert sorted(e["form"] for e in injected) == ["A", "B", "D"]
    assert not [e for e in events if e["event"] == "died"]
    # D's release shows until the next step's audit repairs it, then the pool is exact.
    violations = [e for e in events if e["event"] == "violation"]
    assert violations[0]["phase"] == "released"
    assert violations[-1]["found"] == []
    labels = 'engine="0",kind="double_free",method="free_blocks",model_name="stub"'
    repaired = f"kvqueue_guard_repairs_total{{{labels}}}"
    audit = 'engine="0",kind="listed_free",method="new_step_starts",model_name="stub"'
    found = 'engine="0",kind="listed_free",model_name="stub"'
    before = _kvqueue(first, "kvqueue_guard_") | _kvqueue(first, "kvqueue_audit_")
    assert before
    assert set(before.values()) == {0.0}
    after = _kvqueue(last, "kvqueue_guard_") | _kvqueue(last, "kvqueue_audit_")
    assert after.keys() == before.keys()
    assert after[repaired] == 2
    assert after[f"kvqueue_guard_repairs_total{{{audit}}}"] == 1
    assert after[f"kvqueue_audit_findings_total{{{found}}}"] == 1
    assert sum(after.values()) == 4
    (info,) = _kvqueue(last, "kvqueue_info{").items()
    assert info[1] == 1.0
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
