"""kvqueue's counters on vLLM's ``/metrics``: what the guard refused and repaired, what the
holder audit found, what kvqueue's queues repaired, and whether kvqueue is active, per engine.

vLLM serves ``/metrics`` from its front-end (API-server) process, but the guard runs in each
engine core, a process of its own. So each engine core keeps kvqueue's metrics in
``prometheus_client``'s multiprocess mode: ``Counter`` and ``Gauge`` values written to files
of the process (``counter_kvqueue<pid>.db``), which a ``MultiProcessCollector`` in the front
end reads, in the directory that front end collects:

* ``PROMETHEUS_MULTIPROC_DIR`` when it is set (vLLM sets it for more than one API server,
  before the engine cores start): vLLM's own collector of that directory reads kvqueue's
  files with its own;
* else kvqueue's own directory (``KVQUEUE_METRICS_DIR``), which the plugin makes in the front
  end, where vLLM loads plugins before it starts any engine, so that every engine core
  inherits it; the plugin registers one collector of that directory, and of nothing else, on
  ``prometheus_client``'s default registry, the one vLLM serves with one API server. vLLM's own
  metrics are collected as before, and ``PROMETHEUS_MULTIPROC_DIR`` stays unset for them.

Names start with ``kvqueue_`` (vLLM's Prometheus logger unregisters ``vllm:*`` collectors);
labels ``engine`` (the data-parallel rank) and ``model_name`` as vLLM's. Every counter a
guarded method or the queue can move is written at 0 when the engine core starts. The info
metric is a gauge at 1 with labels (multiprocess mode has no ``Info``), the highest value of
the processes per labels. ``prometheus_client`` (one of vLLM's requirements) is imported only
here, only when the plugin starts the metrics.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from .. import _env, _log, _policy, _render
from . import _registry, _report

__all__ = (
    "COUNTERS",
    "FINDINGS",
    "INDEX_REBUILDS",
    "INFO",
    "QUEUE_REPAIRS",
    "REFUSALS",
    "REPAIRS",
    "Facts",
    "combinations",
    "start",
)

REFUSALS = "kvqueue_guard_refusals"
REPAIRS = "kvqueue_guard_repairs"
FINDINGS = "kvqueue_audit_findings"
QUEUE_REPAIRS = "kvqueue_queue_repairs"
INDEX_REBUILDS = "kvqueue_index_rebuilds"
INFO = "kvqueue_info"
#: The counters, as a scrape names their samples (``<name>_total``).
COUNTERS = (REFUSALS, REPAIRS, FINDINGS, QUEUE_REPAIRS, INDEX_REBUILDS)

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
_ENGINE = ("engine", "model_name")
_LABELS = {
    outcome: _ENGINE + {"rebuilt": (), "found": ("kind",)}.get(outcome, ("method", "kind"))
    for outcome in _OUTCOMES
}
_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
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
class _Engine:
    """This engine core's metrics, once :func:`start` has made them in this process."""

    pid: int
    # prometheus_client's multiprocess value of kvqueue's metrics, and the directory its
    # files are in.
    values: Any
    directory: str
    # The counters by outcome, and the info gauge; none registered in this process.
    counters: dict[str, Any]
    info: Any
    engine: str
    model_name: str
    # What each counter says now, by its outcome and labels.
    written: dict[tuple[str, ...], int] = dataclasses.field(default_factory=dict)
    # The info gauge's labels now at 1.
    info_labels: tuple[str, ...] | None = None


_engine: _Engine | None = None
_collected: set[str] = set()


def combinations(guarded: Sequence[str], audit: bool) -> list[tuple[str, str, str]]:
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


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the plugin found in this process, for ``kvqueue_info`` and the counters:
    ``reason`` why kvqueue is not active (None: it is active), and what runs when it is:
    the ``twin``, the default policy (``on_misuse``), the vLLM line, the ``guarded``
    methods, whether the ``holder_audit`` runs and its steps between full reads."""

    vllm_version: str
    reason: str | None = None
    twin: str = ""
    on_misuse: str = ""
    vllm_line: str = ""
    guarded: tuple[str, ...] = ()
    holder_audit: bool = False
    audit_every: int | None = None

    def labels(self) -> dict[str, str]:
        """The info gauge's labels (but the engine's), as a scrape shows them."""
        if self.reason is not None:
            return {
                "state": "not active",
                # A wrapped refusal, as one line: a label value is read on one.
                "reason": _render.one_line(self.reason)[:300],
                "vllm_version": self.vllm_version,
            }
        return {
            "state": "active",
            "twin": self.twin,
            "on_misuse": self.on_misuse,
            "vllm_line": self.vllm_line,
            "vllm_version": self.vllm_version,
            "pool_guard": "on" if self.guarded else "off",
            "holder_audit": "on" if self.holder_audit else "off",
            "audit_every": "" if self.audit_every is None else str(self.audit_every),
        }


def start(facts: Facts, *, registry: Any = None) -> None:
    """The plugin's part: in an engine process (a ``VllmConfig`` on the calling stack), write
    the info gauge of ``facts`` and, when kvqueue is active, the counters of the guarded
    methods and of the holder audit (if it runs); in a front end, make kvqueue's directory
    and collect it on ``registry`` (prometheus_client's default). O(counters). Never
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
            _publish(labels, facts)
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
    return os.environ.get(_MULTIPROC_DIR) or os.environ.get(_env.METRICS_DIR)


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


def _publish(labels: tuple[str, str], facts: Facts) -> None:
    directory = _directory()
    if directory is None:  # no front end collects: nothing to write
        return
    engine = _made(directory, labels)
    values = {**facts.labels(), "engine": engine.engine, "model_name": engine.model_name}
    shown = tuple(values.get(name, "") for name in _INFO_LABELS)
    if engine.info_labels is not None and engine.info_labels != shown:
        engine.info.labels(*engine.info_labels).set(0)
    with _multiprocess(engine):
        engine.info.labels(*shown).set(1)
    engine.info_labels = shown
    if facts.reason is not None:
        return
    counts = _report.events()
    for event in combinations(facts.guarded, facts.holder_audit):
        _write(*event, counts.get(event, 0))
    for event, count in counts.items():
        _write(*event, count)
    _report.watch(_write)


def _made(directory: str, labels: tuple[str, str]) -> _Engine:
    """This process's metrics, made at its first start (or in a directory of its own)."""
    global _engine
    from prometheus_client import Counter, Gauge
    from prometheus_client.values import MultiProcessValue

    engine = _engine
    pid = os.getpid()
    if engine is None or engine.pid != pid or engine.directory != directory:
        # prometheus_client chose its values' class when it was imported, maybe before this
        # process knew the directory: kvqueue's metrics have a multiprocess class of their
        # own, whose files are named apart from prometheus_client's own files of this
        # process (counter_<pid>.db), which another writer keeps.
        engine = _Engine(
            pid,
            MultiProcessValue(lambda: f"kvqueue{os.getpid()}"),
            directory,
            {
                outcome: Counter(name, _HELP[name], _LABELS[outcome], registry=None)
                for outcome, name in _OUTCOMES.items()
            },
            # One row per engine and state, the highest of the processes' values: the
            # state now at 1, any it left at 0.
            Gauge(INFO, _HELP[INFO], _INFO_LABELS, registry=None, multiprocess_mode="max"),
            *labels,
        )
        _engine = engine
    engine.engine, engine.model_name = labels
    return engine


@contextlib.contextmanager
def _multiprocess(engine: _Engine) -> Iterator[None]:
    """Make ``engine``'s children (a metric's value per labels) in multiprocess mode: in
    ``engine``'s directory, with its values' class, whatever this process's are. A metric's
    children take prometheus_client's class and directory of the moment they are made (it
    offers no argument for either), so both are set for that moment only: at the engine
    core's start, and when a counter no start wrote moves first."""
    from prometheus_client import values

    was_class, was_directory = values.ValueClass, os.environ.get(_MULTIPROC_DIR)
    values.ValueClass = engine.values
    os.environ[_MULTIPROC_DIR] = engine.directory
    try:
        yield
    finally:
        values.ValueClass = was_class
        if was_directory is None:
            del os.environ[_MULTIPROC_DIR]
        else:
            os.environ[_MULTIPROC_DIR] = was_directory


def _write(outcome: str, method: str, kind: str, count: int) -> None:
    """Make ``count`` the value of the counter of (``outcome``, ``method``, ``kind``): written
    at 0 the first time, then moved by what it gained. O(1)."""
    engine = _engine
    if engine is None or engine.pid != os.getpid():  # a forked child writes nothing of its parent's
        return
    counter = engine.counters[outcome]
    given = {"engine": engine.engine, "model_name": engine.model_name}
    given.update(method=method, kind=kind)
    labels = tuple(given[name] for name in _LABELS[outcome])
    key = (outcome, *labels)
    if key not in engine.written:
        with _multiprocess(engine):
            counter.labels(*labels).inc(0)
        engine.written[key] = 0
    moved = count - engine.written[key]
    if moved > 0:
        counter.labels(*labels).inc(moved)
        engine.written[key] = count
