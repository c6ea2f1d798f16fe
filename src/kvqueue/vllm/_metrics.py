"""kvqueue's counters on vLLM's ``/metrics``: what the guard refused and repaired, what the
holder audit found, and whether kvqueue is active, per engine.

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
guarded method can move is written at 0 when the engine core starts. ``prometheus_client``
(one of vLLM's requirements) is imported only here, only when the plugin starts the metrics.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from typing import Any

from .. import _env, _log, _policy
from . import _report

__all__ = ("FINDINGS", "INFO", "REFUSALS", "REPAIRS", "combinations", "start")

REFUSALS = "kvqueue_guard_refusals"
REPAIRS = "kvqueue_guard_repairs"
FINDINGS = "kvqueue_audit_findings"
INFO = "kvqueue_info"

_HELP = {
    REFUSALS: "Misuses of vLLM's BlockPool kvqueue's guard refused (raised) before any change, "
    "by method and kind (method new_step_starts: the holder audit)",
    REPAIRS: "Misuses of vLLM's BlockPool kvqueue's guard repaired, by method and kind "
    "(method new_step_starts: the holder audit)",
    FINDINGS: "Blocks kvqueue's holder audit found held wrongly, by kind, raised or repaired",
    INFO: "kvqueue in this engine: state active or not active (reason), twin, policy, vLLM line, "
    "pool guard and holder audit",
}
_OUTCOMES = {"refused": REFUSALS, "repaired": REPAIRS, "found": FINDINGS}
_AUDIT = "new_step_starts"
# What each guarded method can refuse or repair.
_KINDS: dict[str, tuple[str, ...]] = {
    "free_blocks": ("double_free", "held_free"),
    "unpin_blocks": ("double_free", "held_free"),
    "touch": ("negative_ref",),
    "get_new_blocks": ("held_free", "negative_ref", "listed_free"),
    _AUDIT: _policy.AUDIT_MISUSES,
}
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
)

# This process's files, once an engine core's counts are written: [pid, counters, info,
# labels (engine, model_name), the info's key].
_files: list[Any] = []
_collected: set[str] = set()


def combinations(guarded: list[str], audit: bool) -> list[tuple[str, str, str]]:
    """Every (outcome, method, kind) the guard on ``guarded`` methods (and the audit) can
    count, each written at 0 when an engine core starts."""
    methods = [m for m in _KINDS if m in guarded or (audit and m == _AUDIT)]
    found = [
        (outcome, method, kind)
        for outcome in ("refused", "repaired")
        for method in methods
        for kind in _KINDS[method]
    ]
    if audit:
        found += [("found", _AUDIT, kind) for kind in _policy.AUDIT_MISUSES]
    return found


def start(info: dict[str, str], *, registry: Any = None) -> None:
    """The plugin's part: in an engine process (a ``VllmConfig`` on the calling stack), write
    this process's counters and ``info``; in a front end, make kvqueue's directory and collect
    it on ``registry`` (prometheus_client's default). Never raises: a metric that cannot be
    served is logged, and vLLM runs as it would without it."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return
    try:
        labels = _engine_labels(sys._getframe(1))
        if labels is None:
            _collect(registry)
        else:
            _publish(labels, info)
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


def _publish(labels: tuple[str, str], info: dict[str, str]) -> None:
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    directory = _directory()
    if directory is None:  # no front end collects: nothing to write
        return
    pid = os.getpid()
    if not _files or _files[0] != pid:
        # Named apart from prometheus_client's own files of this process (counter_<pid>.db).
        counters = MmapedDict(os.path.join(directory, f"counter_kvqueue{pid}.db"))
        gauges = MmapedDict(os.path.join(directory, f"gauge_max_kvqueue{pid}.db"))
        _files[:] = [pid, counters, gauges, labels, None]
    _, counters, gauges, labels, old = _files
    _files[3] = labels
    values = {**info, "engine": labels[0], "model_name": labels[1]}
    key = mmap_key(
        INFO, INFO, list(_INFO_LABELS), [values.get(n, "") for n in _INFO_LABELS], _HELP[INFO]
    )
    if old is not None and old != key:
        gauges.write_value(old, 0.0, 0.0)
    gauges.write_value(key, 1.0, 0.0)
    _files[4] = key
    if info.get("state") != "active":
        return
    counts = _report.events()
    guarded = info.get("guarded", "").split(",")
    for event in combinations(guarded, info.get("holder_audit") == "on"):
        _write(*event, counts.get(event, 0))
    for event, count in counts.items():
        _write(*event, count)
    _report.watch(_write)


def _write(outcome: str, method: str, kind: str, count: int) -> None:
    if not _files or _files[0] != os.getpid():  # a forked child writes nothing of its parent's
        return
    from prometheus_client.mmap_dict import mmap_key

    engine, model = _files[3]
    name = _OUTCOMES[outcome]
    if outcome == "found":
        names, values = ["engine", "model_name", "kind"], [engine, model, kind]
    else:
        names, values = ["engine", "model_name", "method", "kind"], [engine, model, method, kind]
    _files[1].write_value(
        mmap_key(name, name + "_total", names, values, _HELP[name]), float(count), 0.0
    )
