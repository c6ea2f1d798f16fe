"""``python -m kvqueue``: what kvqueue does in this environment, and why (for bug reports).

Prints the version, the twin ``import kvqueue`` loads and why, every environment variable
kvqueue reads, and, with vLLM installed, whether kvqueue accepts that vLLM and whether
vLLM's plugin loader will call kvqueue, with which twin, policy and guard. Exits 1 when
the environment asks for what cannot happen (a bad value, ``KVQUEUE_VLLM`` set with vLLM
missing, refused or not loading the plugin); ``--json`` prints the same as one object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from typing import Any

import kvqueue

from . import _env, _policy
from . import vllm as kv_vllm

#: What each variable kvqueue reads does.
MEANINGS: dict[str, str] = {
    _env.VLLM: "1/auto, cython or python: the vLLM plugin installs kvqueue (0 or unset: off)",
    _env.MISUSE_POLICY: "raise (default) or repair: the misuse policy of queues and pool guards",
    _env.POOL_GUARD: "0: the vLLM plugin leaves BlockPool's methods unguarded (default 1)",
    _env.WRAP_FOREIGN: "1: the vLLM plugin installs over another project's patch",
    _env.PURE: "1: import kvqueue loads the pure twin (0 or unset: the compiled one)",
}


def report() -> tuple[dict[str, Any], list[str]]:
    """What ``python -m kvqueue`` says, and the problems that make it exit 1."""
    problems: list[str] = []
    facts: dict[str, Any] = {
        "kvqueue": kvqueue.__version__,
        "location": os.path.dirname(kvqueue.__file__),
        "python": sys.version.split()[0],
        "implementation": kvqueue.IMPLEMENTATION,
        "why": _why(),
        "environment": {name: os.environ.get(name) for name in _env.USER},
    }
    try:
        _policy.resolve(None)
    except ValueError as exc:
        problems.append(str(exc))
    try:
        _env.flag(_env.PURE)
    except ValueError as exc:
        problems.append(str(exc))
    facts["vllm"] = _vllm(problems)
    return facts, problems


def _why() -> str:
    if kvqueue.IMPLEMENTATION == "cython":
        return "the compiled twin (kvqueue._queue) imported"
    if os.environ.get(_env.PURE, "") not in ("", "0"):
        return f"{_env.PURE} is set"
    if sys.implementation.name != "cpython":
        return f"{sys.implementation.name} runs the pure twin"
    try:
        from . import _queue  # noqa: F401
    except ImportError as exc:
        return f"the compiled twin cannot be imported: {exc}"
    return "the pure twin was chosen"


def _vllm(problems: list[str]) -> dict[str, Any]:
    asked = os.environ.get(kv_vllm.ENV, "")
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        if asked not in ("", "0"):
            problems.append(f"{kv_vllm.ENV}={asked} but vLLM is not installed")
        return {"installed": False}
    points = [p for p in metadata.entry_points(group="vllm.general_plugins") if p.name == "kvqueue"]
    allowed = os.environ.get("VLLM_PLUGINS")
    loaded = bool(points) and (allowed is None or "kvqueue" in allowed.split(","))
    info: dict[str, Any] = {
        "installed": True,
        "version": version,
        "VLLM_PLUGINS": allowed,
        "plugin_registered": bool(points),
        "plugin_loaded_by_vllm": loaded,
    }
    try:
        kv_vllm.check()
        info["accepted"] = True
    except Exception as exc:  # whatever stops install() stops vLLM with the plugin on
        info["accepted"] = False
        info["refused"] = f"{type(exc).__name__}: {exc}"
    try:
        settings = kv_vllm.plugin_settings()
    except ValueError as exc:
        problems.append(str(exc))
        return info
    info["plugin"] = settings
    if settings is None:
        return info
    if not loaded:
        problems.append(
            f"{kv_vllm.ENV}={asked} but vLLM will not call kvqueue's plugin "
            + ("(VLLM_PLUGINS does not name kvqueue)" if points else "(its entry point is missing)")
        )
    if not info["accepted"]:
        problems.append(f"{kv_vllm.ENV}={asked} but installing into this vLLM fails")
    return info


def _print(facts: dict[str, Any], problems: list[str]) -> None:
    print(f"kvqueue {facts['kvqueue']} ({facts['location']}), Python {facts['python']}")
    print(f"import kvqueue loads: {facts['implementation']} twin ({facts['why']})")
    print("environment:")
    for name, meaning in MEANINGS.items():
        value = facts["environment"][name]
        setting = f"{name}={value!r}" if value is not None else f"{name} unset"
        print(f"  {setting:<28} {meaning}")
    vllm = facts["vllm"]
    if not vllm["installed"]:
        print("vLLM: not installed")
    else:
        print(f"vLLM {vllm['version']}: " + ("accepted" if vllm["accepted"] else vllm["refused"]))
        print(
            f"  plugin entry point {'registered' if vllm['plugin_registered'] else 'missing'}; "
            f"VLLM_PLUGINS={vllm['VLLM_PLUGINS']!r}: vLLM "
            + ("calls" if vllm["plugin_loaded_by_vllm"] else "does not call")
            + " kvqueue's plugin"
        )
        settings = vllm.get("plugin")
        if settings is None:
            print(f"  the plugin installs nothing ({kv_vllm.ENV} unset or 0)")
        else:
            twin = settings["implementation"]
            policy = settings["on_misuse"] or f"{_policy.resolve(None)} ({_policy.ENV}, per queue)"
            print(
                f"  the plugin installs: {kvqueue.IMPLEMENTATION if twin == 'auto' else twin} "
                f"twin, on_misuse={policy}, "
                f"pool guard {'on' if settings['pool_guard'] else 'off'}"
                + (", over others' patches" if settings["wrap_foreign"] else "")
            )
    for problem in problems:
        print(f"problem: {problem}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvqueue", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    args = parser.parse_args(argv)
    facts, problems = report()
    if args.json:
        json.dump({**facts, "problems": problems}, sys.stdout, indent=1)
        print()
    else:
        _print(facts, problems)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
