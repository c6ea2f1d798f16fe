"""kvqueue's counters on vLLM's ``/metrics``: what the guard refused and repaired, what the
holder audit found, what kvqueue's queues repaired, and whether kvqueue is active, per engine.

vLLM serves ``/metrics`` from its front-end (API-server) process, but the guard runs in each
engine core, a process of its own. So each engine core writes its counts into files that
``prometheus_client``'s ``MultiProcessCollector`` reads (one ``mmap`` store per count that
moves), in the directory a front end collects:

* ``PROMETHEUS_MULTIPROC_DIR`` when it is set (vLLM sets it for more than one API server,
  before the engine cores start): vLLM's own collector of that directory reads kvqueue's
  files with its own;
* else kvqueue's own directory (``KVQUEUE_METRICS_DIR``), which the plugin makes in the front
  end, where vLLM loads plugins before it starts any engine, so that every engine core
  inherits it; the plugin registers one collector of that directory, and of nothing else, on
  ``prometheus_client``'s default registry, the one vLLM serves with one API server. vLLM's own
  metrics are collected as before.

Names start with ``kvqueue_`` (vLLM's Prometheus logger unregisters ``vllm:*`` collectors);
labels ``engine`` (the data-parallel rank) and ``model_name`` as vLLM's. Every counter a
guarded method or the queue can move is written at 0 when the engine core starts.
``prometheus_client`` (one of vLLM's requirements) is imported only here, only when the plugin
starts the metrics.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from .. import _env, _log, _policy
from . import _registry, _report

__all__ = ("FINDINGS", "INFO", "QUEUE_REPAIRS", "REFUSALS", "REPAIRS", "combinations", "start")

REFUSALS = "kvqueue_guard_refusals"
REPAIRS = "kvqueue_guard_repairs"
FINDINGS = "kvqueue_audit_findings"
QUEUE_REPAIRS = "kvqueue_queue_repairs"
INDEX_REBUILDS = "kvqueue_index_rebuilds"
INFO = "kvqueue_info"

_HELP = {
    REFUSALS: "Misuses of vLLM's BlockPool kvqueue's guard refused (raised) before any change, "
    "by method and kind (method new_step_starts: the holder audit)",
    REPAIRS: "Misuses of vLLM's BlockPool kvqueue's guard repaired, by method and kind "
    "(method new_step_starts: the holder audit)",
    FINDINGS: "Blocks kvqueue's holder audit found held wrongly, by kind, raised or repaired",
    QUEUE_REPAIRS: "Misuses of vLLM's free block queue kvqueue's queue repaired, by method and "
    "kind",
    INDEX_REBUILDS: "Times a full read of the listings found kvqueue's holder index stale (a "
    "listing changed out of its sight) and rebuilt it",
    INFO: "kvqueue in this engine: state active or not active (reason), twin, policy, vLLM line, "
    "pool guard, holder audit and its steps between full reads",
}
_OUTCOMES = {
    "refused": REFUSALS,
    "repaired": REPAIRS,
    "found": FINDINGS,
    "queue_repaired": QUEUE_REPAIRS,
    "rebuilt": INDEX_REBUILDS,
}
_AUDIT = _registry.AUDIT_HOOK
_KINDS: dict[str, tuple[str, ...]] = dict(_registry.KINDS)
_INFO_LABELS = (
    "engine",
    "model_name",
    "state",
    "reason",
    "twin",
    "on_misuse",
    "vllm_line",
    "vllm_version",
    "pool_guard",
    "holder_audit",
    "audit_every",
)


@dataclasses.dataclass
class _Files:
    """This process's files, once an engine core's counts are written."""

    pid: int
    counters: Any  # prometheus_client's MmapedDict of the counters
    gauges: Any  # ... of the info gauge
    labels: tuple[str, str]  # engine, model_name
    info_key: str | None = None  # the info gauge's key now written at 1


_files: _Files | None = None
_collected: set[str] = set()


def combinations(guarded: list[str], audit: bool) -> list[tuple[str, str, str]]:
    """Every (outcome, method, kind) the guard on ``guarded`` methods (and the audit) and
    kvqueue's queue can count, each written at 0 when an engine core starts."""
    # The free list's entry is checked where the holder index is kept: with the guard.
    entry = bool(guarded) and audit
    methods = [
        m
        for m in _KINDS
        if m in guarded or (audit and m == _AUDIT) or (entry and m in _registry.ENTRY)
    ]
    found = [
        (outcome, method, kind)
        for outcome in ("refused", "repaired")
        for method in methods
        for kind in _KINDS[method]
    ]
    if audit:
        found += [("found", _AUDIT, kind) for kind in _policy.AUDIT_MISUSES]
        found.append(("rebuilt", _AUDIT, "index_stale"))
    found += [
        ("queue_repaired", method, kind)
        for method, kinds in _policy.QUEUE_REPAIRS.items()
        for kind in kinds
    ]
    return found


def start(
    info: dict[str, str],
    *,
    guarded: Sequence[str] = (),
    audit: bool = False,
    registry: Any = None,
) -> None:
    """The plugin's part: in an engine process (a ``VllmConfig`` on the calling stack), write
    ``info`` (the info gauge's labels) and, when kvqueue is active, the counters of the
    ``guarded`` methods and of the holder ``audit`` (if it runs); in a front end, make
    kvqueue's directory and collect it on ``registry`` (prometheus_client's default). Never
    raises: a metric that cannot be served is logged, and vLLM runs as it would without it."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return
    try:
        labels = _engine_labels(sys._getframe(1))
        if labels is None:
            _collect(registry)
        else:
            _publish(labels, info, guarded, audit)
    except Exception as exc:  # metrics must never stop vLLM
        _log.logger.warning("kvqueue's metrics are not served: %s: %s", type(exc).__name__, exc)


def _engine_labels(frame: Any) -> tuple[str, str] | None:
    """(engine, model_name) of the engine this process runs, read from the ``vllm_config``
    and ``dp_rank`` that vLLM's engine start has on the stack; None outside an engine."""
    config = rank = None
    while frame is not None:
        names = frame.f_locals
        if config is None and type(names.get("vllm_config")).__name__ == "VllmConfig":
            config = names["vllm_config"]
        if rank is None and type(names.get("dp_rank")) is int:
            rank = names["dp_rank"]
        frame = frame.f_back
    if config is None:
        return None
    if rank is None:
        rank = getattr(config.parallel_config, "data_parallel_rank", 0)
    model = getattr(config.model_config, "served_model_name", None)
    return str(rank), str(model)


def _directory() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get(_env.METRICS_DIR)


def _collect(registry: Any) -> None:
    from prometheus_client import REGISTRY
    from prometheus_client.multiprocess import MultiProcessCollector

    path = os.environ.get(_env.METRICS_DIR)
    if not path or not os.path.isdir(path):
        path = tempfile.mkdtemp(prefix="kvqueue-metrics-")
        atexit.register(shutil.rmtree, path, True)
        os.environ[_env.METRICS_DIR] = path
    target = REGISTRY if registry is None else registry
    key = f"{id(target)}:{path}"
    if key not in _collected:
        MultiProcessCollector(target, path=path)
        _collected.add(key)


def _publish(
    labels: tuple[str, str], info: dict[str, str], guarded: Sequence[str], audit: bool
) -> None:
    global _files
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    directory = _directory()
    if directory is None:  # no front end collects: nothing to write
        return
    pid = os.getpid()
    if _files is None or _files.pid != pid:
        # Named apart from prometheus_client's own files of this process (counter_<pid>.db).
        _files = _Files(
            pid,
            MmapedDict(os.path.join(directory, f"counter_kvqueue{pid}.db")),
            MmapedDict(os.path.join(directory, f"gauge_max_kvqueue{pid}.db")),
            labels,
        )
    files = _files
    files.labels = labels
    values = {**info, "engine": labels[0], "model_name": labels[1]}
    key = mmap_key(
        INFO, INFO, list(_INFO_LABELS), [values.get(n, "") for n in _INFO_LABELS], _HELP[INFO]
    )
    if files.info_key is not None and files.info_key != key:
        files.gauges.write_value(files.info_key, 0.0, 0.0)
    files.gauges.write_value(key, 1.0, 0.0)
    files.info_key = key
    if info.get("state") != "active":
        return
    counts = _report.events()
    for event in combinations(list(guarded), audit):
        _write(*event, counts.get(event, 0))
    for event, count in counts.items():
        _write(*event, count)
    _report.watch(_write)


def _write(outcome: str, method: str, kind: str, count: int) -> None:
    files = _files
    if files is None or files.pid != os.getpid():  # a forked child writes nothing of its parent's
        return
    from prometheus_client.mmap_dict import mmap_key

    engine, model = files.labels
    name = _OUTCOMES[outcome]
    if outcome == "rebuilt":
        names, values = ["engine", "model_name"], [engine, model]
    elif outcome == "found":
        names, values = ["engine", "model_name", "kind"], [engine, model, kind]
    else:
        names, values = ["engine", "model_name", "method", "kind"], [engine, model, method, kind]
    files.counters.write_value(
        mmap_key(name, name + "_total", names, values, _HELP[name]), float(count), 0.0
    )
