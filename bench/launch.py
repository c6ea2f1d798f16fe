"""Fresh processes, one per job: the launcher both harnesses share, and the worker's CPU pin.

``run(command, jobs, label)`` starts ``command + [json.dumps(job)]`` for each job in turn and
reads one JSON object from the last line of its stdout; a failing worker stops the run with
its stderr. Each worker calls ``pin()`` first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


def run(
    command: list[str], jobs: list[dict[str, Any]], label: Callable[[dict[str, Any]], str]
) -> list[dict[str, Any]]:
    records = []
    started = time.monotonic()
    tty = sys.stderr.isatty()
    for done, job in enumerate(jobs, 1):
        proc = subprocess.run(
            [*command, json.dumps(job)], capture_output=True, text=True, check=False
        )
        if proc.returncode:
            sys.stderr.write(proc.stderr[-5000:])
            raise SystemExit(f"worker failed on {label(job)}")
        records.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        elapsed = time.monotonic() - started
        eta = elapsed / done * (len(jobs) - done)
        line = (
            f"[{done:>4}/{len(jobs)}] {label(job):<48} {elapsed:5.0f}s elapsed, ~{eta:4.0f}s left"
        )
        print(f"\r{line}" if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
    if tty:
        print(file=sys.stderr)
    return records


def pin(cpu: int | None) -> int | None:
    """Pin this process to one CPU (the last allowed one unless told), if the OS allows."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    chosen = allowed[-1] if cpu is None else cpu
    try:
        os.sched_setaffinity(0, {chosen})
    except OSError:
        return None
    return chosen
