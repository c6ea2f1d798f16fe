"""What a result was measured on: host, interpreter, compiler and the kvqueue under test.

Recorded in every results file, and named under every table and chart.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import sysconfig
from importlib import metadata
from typing import Any


def describe() -> dict[str, Any]:
    import kvqueue

    return {
        "host": platform.node(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "python_build": " ".join(platform.python_build()),
        "cython": _version("Cython"),
        "compiler": _compiler(),
        "cflags": sysconfig.get_config_var("CFLAGS") or "",
        "kvqueue": kvqueue.__version__,
        "kvqueue_implementation": kvqueue.IMPLEMENTATION,
        "kvqueue_path": os.path.dirname(kvqueue.__file__),
        "checkout": checkout(),
    }


def checkout() -> str:
    """The commit of the benchmark's own checkout (the kvqueue timed may be another build)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "-C", here, "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout
    except OSError:
        return "unknown"
    return out.strip() or "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("model name", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    # aarch64 kernels give only part numbers; lscpu knows their names (e.g. Neoverse-V2).
    try:
        out = subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except OSError:
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def short(info: dict[str, Any]) -> str:
    """One line naming the host, e.g. for a table caption or a chart title."""
    return (
        f"{info['cpu']} ({info['machine']}, {info['cpus']} CPUs), {info['os']}; "
        f"{info['python_implementation']} {info['python']}; {_cython(info)} with "
        f"{info['compiler']}; kvqueue {info['kvqueue']} ({info['kvqueue_implementation']})"
    )


def _cython(info: dict[str, Any]) -> str:
    """Which Cython built the timed compiled twin: the benchmark's venv builds kvqueue without
    isolation, with its own Cython (make bench), so that one is it; without one, unknown."""
    if info["cython"] == "not installed":
        return "compiled twin built by a Cython not in this environment"
    return f"compiled twin built by Cython {info['cython']}"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _compiler() -> str:
    """The C compiler an extension build would use, with its version."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    try:
        out = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except OSError:
        return f"{cc} (not found)"
    return out.splitlines()[0].strip() if out else cc
