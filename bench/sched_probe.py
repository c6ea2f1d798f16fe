"""Where a scheduler step's CPU time goes: a sampling profiler on the process's CPU clock.

``Sampler`` arms ``ITIMER_PROF`` (the process's CPU time, so time given to other jobs on a
shared host is never sampled) and, at every tick, walks the interrupted Python stack. A
sample is *in a step* when ``Scheduler.schedule`` or ``Scheduler.update_from_output`` is on
the stack, and is charged to every layer found on it:

* ``kv_manager``: vLLM's KV-cache management (kv_cache_manager.py, its coordinator, the
  single-type managers, the block pool);
* ``pool``: a ``BlockPool`` method (block_pool.py), the queue calls it makes included;
* ``queue``: a free-queue method written in Python (vLLM's own, or kvqueue's pure twin);
* ``kvqueue``: any other function of the kvqueue package written in Python (the pool guard's
  pure twin and its wrappers around vLLM's pool methods).
  The compiled twin runs in C, where a signal is only seen once it returns, so its time
  lands on its caller: its queue share is measured by replay (bench/scheduler.py), not here.

Why sampling and not timers around the methods: a thread-CPU-time read is a system call
(about 0.4 us here), and the pool's methods are called hundreds of times a step for a few
microseconds each, so timers would cost more than much of what they time. A tick costs a
stack walk (some microseconds) and charges nothing to the code it interrupts; its error is
statistical (a share p from n samples: +-2*sqrt(p(1-p)/n)), and the run reports n.
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType
from typing import Any

import kvqueue

__all__ = ("Sampler",)

_MANAGER_FILES = {
    "kv_cache_manager.py",
    "kv_cache_coordinator.py",
    "single_type_kv_cache_manager.py",
    "block_pool.py",
}
_KVQUEUE_DIR = str(Path(kvqueue.__file__).resolve().parent) + "/"


class Sampler:
    """Counts CPU-clock ticks per layer while armed (``with Sampler(...) as s:``)."""

    def __init__(self, interval_s: float, step_codes: set[Any], queue_codes: set[Any]) -> None:
        self.interval = interval_s
        self.step_codes = step_codes
        self.queue_codes = queue_codes
        self.counts = dict.fromkeys(("ticks", "step", "kv_manager", "pool", "queue", "kvqueue"), 0)
        self._busy = False
        self._file_kind: dict[str, str | None] = {}

    def _kind(self, filename: str) -> str | None:
        kind = self._file_kind.get(filename, "")
        if kind == "":
            name = Path(filename).name
            if name == "block_pool.py":
                kind = "pool"
            elif name in _MANAGER_FILES:
                kind = "kv_manager"
            elif str(Path(filename).resolve()).startswith(_KVQUEUE_DIR):
                kind = "kvqueue"
            else:
                kind = None
            self._file_kind[filename] = kind
        return kind

    def _tick(self, _signum: int, frame: FrameType | None) -> None:
        if self._busy:  # a tick that lands in this handler is the profiler's own time
            return
        self._busy = True
        counts = self.counts
        counts["ticks"] += 1
        in_step = in_manager = in_pool = in_queue = in_kvqueue = False
        while frame is not None:
            code = frame.f_code
            if code in self.step_codes:
                in_step = True
            elif code in self.queue_codes:
                in_queue = True
            else:
                kind = self._kind(code.co_filename)
                if kind == "pool":
                    in_pool = in_manager = True
                elif kind == "kv_manager":
                    in_manager = True
                elif kind == "kvqueue":
                    in_kvqueue = True
            frame = frame.f_back
        if in_step:
            counts["step"] += 1
            counts["kv_manager"] += in_manager
            counts["pool"] += in_pool
            counts["queue"] += in_queue
            counts["kvqueue"] += in_kvqueue
        self._busy = False

    def __enter__(self) -> Sampler:
        self._previous = signal.signal(signal.SIGPROF, self._tick)
        signal.setitimer(signal.ITIMER_PROF, self.interval, self.interval)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, self._previous)


def method_codes(*classes: type) -> set[Any]:
    """The code objects of every function defined in ``classes`` (not inherited)."""
    codes = set()
    for cls in classes:
        for value in vars(cls).values():
            func = getattr(value, "__func__", value)
            code = getattr(func, "__code__", None)
            if code is not None:
                codes.add(code)
            if isinstance(value, property) and value.fget is not None:
                codes.add(value.fget.__code__)
    return codes
