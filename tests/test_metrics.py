"""kvqueue's counters for vLLM's /metrics (``kvqueue.vllm._metrics``): every refusal and repair of
the guard counted by method and kind, and written where a front end's collector reads them
(the live route, through ``vllm serve``, is in vllm_tests/test_live_engine.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvqueue import _env, _render
from kvqueue.vllm import _metrics, _report
from kvqueue.vllm._lines import LINES

from support.fake_pool import guarded, make_pool
from support.helpers import raises_said

NEWEST = LINES[-1]
GUARDED = ("free_blocks", "get_new_blocks", "touch", "unpin_blocks")
ACTIVE = _metrics.Facts(
    NEWEST.release,
    twin="cython",
    on_misuse="repair",
    vllm_line=NEWEST.name,
    guarded=GUARDED,
    holder_audit=True,
    audit_every=64,
)


@pytest.fixture
def quiet(repair_log: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    return repair_log


@pytest.mark.parametrize("policy", ["raise", "repair"])
def test_a_double_free_is_counted_by_outcome_method_and_kind(
    queue_mod: ModuleType, policy: str, quiet: Any
) -> None:
    seen: list[tuple[str, str, str, int]] = []
    outcome = "refused" if policy == "raise" else "repaired"
    key = (outcome, "free_blocks", "double_free")
    before = _report.events().get(key, 0)
    _report.watch(lambda *event: seen.append(event))
    try:
        with guarded(queue_mod, NEWEST) as cls:
            pool = make_pool(cls, queue_mod, 8, policy)
            (block,) = pool.get_new_blocks(1)
            if policy == "raise":
                with raises_said(ValueError, "double free"):
                    pool.free_blocks([block, block])
            else:
                pool.free_blocks([block, block])
    finally:
        _report.watch(None)
    assert _report.events()[key] == before + 1
    assert seen == [(*key, before + 1)]


def test_a_negative_count_refused_by_touch_and_get_new_blocks(queue_mod: ModuleType) -> None:
    before = _report.events()
    with guarded(queue_mod, NEWEST) as cls:
        pool = make_pool(cls, queue_mod, 8, "raise")
        (block,) = pool.get_new_blocks(1)
        block.ref_cnt = -1
        with raises_said(ValueError, "double free"):
            pool.touch([block])
        block.ref_cnt = 1
        pool.free_block_queue.append(block)  # held, and in the free list
        with raises_said(ValueError, "double free"):
            pool.get_new_blocks(pool.free_block_queue.num_free_blocks)
    after = _report.events()
    for event in [("refused", "touch", "negative_ref"), ("refused", "get_new_blocks", "held_free")]:
        assert after[event] == before.get(event, 0) + 1


def test_every_counter_an_engine_can_move() -> None:
    found = _metrics.combinations(GUARDED, True)
    assert ("refused", "free_blocks", "double_free") in found
    assert ("repaired", "new_step_starts", "listed_free") in found
    assert ("found", "new_step_starts", "under_counted") in found
    assert ("queue_repaired", "append", "linked") in found
    # The free list's exit refuses or repairs a block a live request lists.
    assert ("repaired", "get_new_blocks", "listed_free") in found
    # The free list's entry refuses or repairs a held or listed block, at each of its doors.
    assert ("refused", "prepend_n", "listed_free") in found
    # A free refuses or repairs a release below the block's holders.
    assert ("repaired", "free_blocks", "under_counted") in found
    queue = 2 + 3 + 4 + 4 + 2
    entry = 3 * 2
    assert len(found) == len(set(found)) == 2 * (3 + 2 + 4 + 2 + entry + 4) + 4 + 1 + queue
    unguarded = _metrics.combinations([], False)
    assert not any(method == "new_step_starts" for _, method, _ in unguarded)
    assert len(unguarded) == queue


# --- through prometheus_client, as vLLM's front end collects them ------------------------


class VllmConfig:
    """Named as vLLM's: how the metrics know an engine process, and its labels."""

    class parallel_config:
        data_parallel_rank = 0

    class model_config:
        served_model_name = "stub-model"


def _as_engine(facts: _metrics.Facts, dp_rank: int = 1) -> None:
    vllm_config = VllmConfig()  # noqa: F841 -- read from this frame, as from vLLM's engine start
    _metrics.start(facts)


def _not_active(reason: str) -> _metrics.Facts:
    return _metrics.Facts(NEWEST.release, reason=reason)


@pytest.fixture
def scraped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    """The text a scrape of a fresh registry returns, after the front end's start."""
    client = pytest.importorskip("prometheus_client")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv(_env.METRICS_DIR, str(tmp_path))
    registry = client.CollectorRegistry()
    _metrics.start(ACTIVE, registry=registry)
    try:
        yield lambda: client.generate_latest(registry).decode()
    finally:
        _report.watch(None)
        _metrics._engine = None


def _value(text: str, sample: str) -> float:
    return next(float(row.rsplit(" ", 1)[1]) for row in text.splitlines() if row.startswith(sample))


def test_an_engines_counters_are_at_0_from_the_first_scrape_and_move(scraped: Any) -> None:
    _as_engine(ACTIVE)
    text = scraped()
    labels = 'engine="1",kind="double_free",method="free_blocks",model_name="stub-model"'
    refused = f"kvqueue_guard_refusals_total{{{labels}}}"
    assert "# TYPE kvqueue_guard_refusals_total counter" in text
    before = _report.events().get(("refused", "free_blocks", "double_free"), 0)
    assert _value(text, refused) == before
    rows = [row for row in text.splitlines() if row.startswith("kvqueue_") and "_total{" in row]
    assert len(rows) == len(_metrics.combinations(GUARDED, True))
    info = 'kvqueue_info{audit_every="64",engine="1",holder_audit="on",model_name="stub-model"'
    assert info in text
    assert 'state="active"' in text
    assert f'vllm_line="{NEWEST.name}"' in text
    _report.count_refusal("free_blocks", "double_free")
    _report.count_finding("listed_free")
    text = scraped()
    assert _value(text, refused) == before + 1
    assert _value(text, 'kvqueue_audit_findings_total{engine="1",kind="listed_free"') >= 1


def test_not_active_says_why(scraped: Any) -> None:
    _as_engine(_not_active("vLLM 9.9.9 is not\n  accepted"))  # a wrapped refusal: one line
    text = scraped()
    assert 'reason="vLLM 9.9.9 is not accepted"' in text
    assert 'state="not active"' in text
    assert "_total{" not in text


def test_a_wrapped_refusal_is_its_label_word_for_word() -> None:
    """Wrapped for a traceback, a reason is its own text again in the label: its line breaks
    and their indents undone, a value's own spaces kept."""
    said = (
        "vLLM 9.9.9 is not what kvqueue knows of vLLM 9.9: BlockPool.free_blocks has a "
        "parameter kvqueue does not know ('ordered  blocks', two spaces in its name), "
        "and kvqueue changes nothing of a BlockPool it does not know"
    )
    wrapped = _render.wrap(said, len("kvqueue.vllm.VLLMLayoutError: "))
    assert wrapped.count("\n") == 2
    assert _not_active(wrapped).labels()["reason"] == said


def test_a_switch_of_state_leaves_one_info_at_1(scraped: Any) -> None:
    _as_engine(_not_active("x"))
    _as_engine(ACTIVE)
    rows = [row for row in scraped().splitlines() if row.startswith("kvqueue_info{")]
    assert sorted(float(row.rsplit(" ", 1)[1]) for row in rows) == [0.0, 1.0]


def test_vllms_multiprocess_directory_is_used_when_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, scraped: Any
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    vllms = tmp_path / "vllm"
    vllms.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(vllms))
    _as_engine(ACTIVE, dp_rank=0)
    assert os.listdir(vllms)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(vllms))
    assert 'kvqueue_guard_repairs_total{engine="0"' in generate_latest(registry).decode()


def test_a_front_end_makes_its_directory_once(monkeypatch: pytest.MonkeyPatch) -> None:
    client = pytest.importorskip("prometheus_client")
    monkeypatch.delenv(_env.METRICS_DIR, raising=False)
    registry = client.CollectorRegistry()
    _metrics.start(ACTIVE, registry=registry)
    made = os.environ[_env.METRICS_DIR]
    _metrics.start(ACTIVE, registry=registry)
    assert os.environ[_env.METRICS_DIR] == made
    assert os.path.isdir(made)
    assert len(list(registry._collector_to_names)) == 1


def test_prometheus_clients_own_mode_is_left_as_it_was(scraped: Any, tmp_path: Path) -> None:
    """kvqueue's metrics are written in their own files; this process's other metrics keep
    the values' class and the environment prometheus_client had."""
    from prometheus_client import values

    was = values.ValueClass
    _as_engine(ACTIVE)
    assert values.ValueClass is was
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    assert sorted(os.listdir(tmp_path)) == [
        f"counter_kvqueue{os.getpid()}.db",
        f"gauge_max_kvqueue{os.getpid()}.db",
    ]


def test_a_second_start_counts_nothing_twice(scraped: Any) -> None:
    _report.count_refusal("unpin_blocks", "double_free")
    _as_engine(ACTIVE)
    first = scraped()
    _as_engine(ACTIVE)
    assert scraped() == first
    refused = 'kvqueue_guard_refusals_total{engine="1",kind="double_free",method="unpin_blocks"'
    assert _value(first, refused) == _report.events()[("refused", "unpin_blocks", "double_free")]


def test_the_plugin_hands_the_metrics_what_status_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values, not text: the info gauge's labels are made from them, here only."""
    from kvqueue.vllm import _plugin

    monkeypatch.setenv("KVQUEUE_ON_MISUSE", "repair")
    status = {
        "implementation": "python",
        "on_misuse": None,
        "line": NEWEST.name,
        "guarded": ["free_blocks", "touch"],
        "holder_audit": False,
        "audit_every": None,
    }
    facts = _plugin._active(status)
    assert facts.guarded == ("free_blocks", "touch")
    assert (facts.holder_audit, facts.audit_every) == (False, None)
    labels = facts.labels()
    assert (labels["on_misuse"], labels["pool_guard"], labels["holder_audit"]) == (
        "repair",
        "on",
        "off",
    )
    assert labels["audit_every"] == ""
    assert _metrics.combinations(facts.guarded, facts.holder_audit) == _metrics.combinations(
        ["free_blocks", "touch"], False
    )
