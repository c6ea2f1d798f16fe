"""pytest plugin: run vLLM's own tests with kvqueue's queue dropped in (``-p kvqueue_plugin``).

``--kvqueue=none|cython|python`` (default ``$KVQUEUE_CI_TWIN``, else ``none``): with a twin,
``kvqueue.vllm.install(twin, on_misuse=--kvqueue-on-misuse)`` runs before pytest imports
vLLM's conftest files and test modules, so every name they import is the patched one.

Whatever the choice, ``BlockPool.__init__`` is wrapped: a test in which a pool was built
with any other queue class than the expected one (kvqueue's twin, or vLLM's own for
``none``) fails, whatever the test itself asserted; so does a test after which one of
``BlockPool``'s guarded methods is not the one installed (the same object: kvqueue's
guards, or vLLM's own methods for ``none``). The number of pools a test built is
kept in its report (``user_properties``) and summed in the terminal summary.

``--kvqueue-report=PATH`` writes ``{nodeid: {"outcome": ..., "pools": n}}`` as JSON at the
end (under xdist, on the controller), the outcome being the worst of the test's phases, or
``deselected`` for a test that ``--deselect`` left out.

vLLM's own ``skip_global_cleanup`` marker is put on every test: its docstring calls it a
~10x speedup for tests that need no device; without it every test ends with a full
``gc.collect()`` and distributed teardown (about 2 s here).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import no_triton
import pytest
from vllm.v1.core import block_pool, kv_cache_utils

TWINS = ("none", "cython", "python")
_RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "failed": 2, "error": 3}

_expected: type | None = None
# The holder audit's findings (kvqueue.vllm.audit_findings), steps audited, and holder index
# rebuilds (a full read that found the index stale) before a test.
_audit_before: tuple[dict[str, int], int, int] | None = None
# BlockPool's methods as installed (kvqueue's guards, or vLLM's own for ``none``): each test
# must leave them in place. Taken by identity: kvqueue marks its guards no other way.
_methods: dict[str, Any] = {}
_built: list[type] = []
_results: dict[str, dict[str, Any]] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvqueue")
    group.addoption(
        "--kvqueue",
        choices=TWINS,
        default=os.environ.get("KVQUEUE_CI_TWIN") or "none",
        help="queue under vLLM: its own (none) or a kvqueue twin",
    )
    group.addoption(
        "--kvqueue-on-misuse",
        choices=("raise", "repair"),
        default=None,
        help="on_misuse policy given to kvqueue.vllm.install()",
    )
    group.addoption("--kvqueue-report", default=None, help="write the outcomes as JSON here")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    global _expected
    twin = early_config.known_args_namespace.kvqueue
    policy = early_config.known_args_namespace.kvqueue_on_misuse
    no_triton.allow()  # every way alike: vLLM 0.34+ on an x86 CPU without triton-cpu

    if twin == "none":
        _expected = kv_cache_utils.FreeKVCacheBlockQueue
    else:
        import kvqueue.vllm

        _expected = kvqueue.vllm.install(twin, on_misuse=policy)
        assert kvqueue.vllm.status()["pool_guard"], "kvqueue's pool guard is not on"
    names = ("get_new_blocks", "touch", "free_blocks", "unpin_blocks")
    _methods.update((name, vars(block_pool.BlockPool)[name]) for name in names
                    if name in vars(block_pool.BlockPool))  # fmt: skip
    original = block_pool.BlockPool.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _built.append(type(self.free_block_queue))

    block_pool.BlockPool.__init__ = __init__


def pytest_report_header(config: pytest.Config) -> str:
    guarded = "unguarded"
    if config.getoption("kvqueue") != "none":
        import kvqueue.vllm

        guarded = "guarded: " + ", ".join(kvqueue.vllm.status()["guarded"])
    return f"kvqueue: {config.getoption('kvqueue')}, BlockPool queue class {_expected!r}, {guarded}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker("skip_global_cleanup")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    global _audit_before
    _built.clear()
    _audit_before = _audit_state()
    return (yield)


def _audit_state() -> tuple[dict[str, int], int, int] | None:
    if _expected is kv_cache_utils.FreeKVCacheBlockQueue:
        return None
    import kvqueue.vllm
    from kvqueue.vllm import _report

    return kvqueue.vllm.audit_findings(), kvqueue.vllm.audited_steps(), _report.index_rebuilds()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    result = yield
    wrong = [f"a BlockPool was built with {cls!r}, not {_expected!r}"
             for cls in set(_built) if cls is not _expected]  # fmt: skip
    # Every pool method must still be the one installed (with a twin: the guard).
    wrong += [f"BlockPool.{name} is no longer the method installed"
              for name, method in _methods.items()
              if vars(block_pool.BlockPool).get(name) is not method]  # fmt: skip
    item.user_properties.append(("kvqueue_pools", len(_built)))
    # vLLM's own tests must give the holder audit nothing to report (a test that expects an
    # exception would otherwise hide one it raised).
    after = _audit_state()
    if after is not None and _audit_before is not None:
        found = {k: n - _audit_before[0][k] for k, n in after[0].items() if n > _audit_before[0][k]}
        if found:
            wrong.append(f"the holder audit reported {found}")
        # Nor may a full read find the holder index stale (KVQUEUE_AUDIT_EVERY=1: at every
        # step, the index against every listing read again).
        if after[2] > _audit_before[2]:
            wrong.append(f"the holder index was found stale {after[2] - _audit_before[2]} times")
        item.user_properties.append(("kvqueue_audits", after[1] - _audit_before[1]))
    if wrong:
        raise AssertionError("kvqueue_plugin: " + "; ".join(sorted(wrong)))
    return result


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "pools": 0})
    if report.when == "call":
        outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
        entry["pools"] = dict(report.user_properties).get("kvqueue_pools", 0)
        entry["audits"] = dict(report.user_properties).get("kvqueue_audits", 0)
    elif report.failed:
        outcome = "error"
    else:
        outcome = report.outcome
    if _RANK[outcome] > _RANK[entry["outcome"]]:
        entry["outcome"] = outcome


def pytest_deselected(items: list[pytest.Item]) -> None:
    # Kept so that run.py can tell an exclusion that names no test of the release.
    for item in items:
        _results[item.nodeid] = {"outcome": "deselected", "pools": 0}


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _results[report.nodeid] = {"outcome": "error", "pools": 0}


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    tests = sum(1 for entry in _results.values() if entry["pools"])
    pools = sum(entry["pools"] for entry in _results.values())
    audited = sum(1 for entry in _results.values() if entry.get("audits"))
    audits = sum(entry.get("audits", 0) for entry in _results.values())
    terminalreporter.write_line(
        f"kvqueue: {config.getoption('kvqueue')}: {tests} tests built {pools} block pools, "
        f"each checked to hold {_expected!r}; the holder audit ran {audits} times in "
        f"{audited} tests and reported nothing, nor found the holder index stale"
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("kvqueue_report")
    if path and not hasattr(session.config, "workerinput"):
        with open(path, "w", encoding="utf-8") as out:
            json.dump(_results, out, indent=1, sort_keys=True)
