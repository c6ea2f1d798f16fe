"""``python -m kvqueue``: what kvqueue does in this environment, and why (for bug reports).

Prints the version, the twin ``import kvqueue`` loads and why, every environment variable
kvqueue reads, the installed vLLM's version and what the table of accepted lines says of it,
and what vLLM's plugin loader will make of them: the plan that kvqueue's
plugin itself carries out (``kvqueue._vllm_plugin.plan``). Exits 1 when the environment asks
for what cannot happen (a bad value, a vLLM kvqueue refuses under a strict KVQUEUE_VLLM, a
plugin vLLM will not call); --json prints the same as one object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from importlib import metadata
from typing import Any

import kvqueue

from . import _env, _vllm_lines, _vllm_plugin


def report() -> tuple[dict[str, Any], list[str]]:
    """What ``python -m kvqueue`` says, and the problems that make it exit 1."""
    problems: list[str] = []
    try:
        _env.flag(_env.PURE)
    except ValueError as exc:
        problems.append(str(exc))
    decided = _vllm_plugin.plan()
    problems += decided.problems
    facts: dict[str, Any] = {
        "kvqueue": kvqueue.__version__,
        "location": os.path.dirname(kvqueue.__file__),
        "python": sys.version.split()[0],
        "implementation": kvqueue.IMPLEMENTATION,
        "why": _why(),
        "environment": {name: os.environ.get(name) for name in _env.USER},
        "accepted_vllm_lines": [line.release for line in _vllm_lines.LINES],
    }
    vllm = _vllm()
    facts["vllm"] = vllm
    facts["plugin"] = {
        "action": decided.action,
        "reason": decided.reason,
        "settings": decided.settings,
    }
    if decided.action == "refuse" and not decided.problems:
        problems.append(decided.reason)
    elif decided.action != "off" and vllm.get("installed") and not vllm["plugin_loaded_by_vllm"]:
        problems.append(
            f"{_env.VLLM}={os.environ.get(_env.VLLM)} but vLLM will not call kvqueue's plugin "
            + (
                "(VLLM_PLUGINS does not name kvqueue)"
                if vllm["plugin_registered"]
                else "(its entry point is missing)"
            )
        )
    return facts, problems


def _why() -> str:
    if kvqueue.IMPLEMENTATION == "cython":
        return "the compiled twin (kvqueue._queue) imported"
    if os.environ.get(_env.PURE, "") == "1":
        return f"{_env.PURE}=1"
    if sys.implementation.name != "cpython":
        return f"{sys.implementation.name} runs the pure twin"
    try:
        from . import _queue  # noqa: F401
    except ImportError as exc:
        return f"the compiled twin cannot be imported: {exc}"
    return "the pure twin was chosen"


def _vllm() -> dict[str, Any]:
    """Whether vLLM is importable (with or without its distribution's metadata), and
    whether its plugin loader will call kvqueue's entry point."""
    if importlib.util.find_spec("vllm") is None:
        return {"installed": False}
    points = [p for p in metadata.entry_points(group="vllm.general_plugins") if p.name == "kvqueue"]
    allowed = os.environ.get("VLLM_PLUGINS")
    # Its distribution's version: importing vLLM to ask it would take seconds.
    try:
        version: str | None = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        version = None
    return {
        "installed": True,
        "version": version,
        "verdict": _vllm_lines.verdict(version),
        "VLLM_PLUGINS": allowed,
        "plugin_registered": bool(points),
        "plugin_loaded_by_vllm": bool(points)
        and (allowed is None or "kvqueue" in allowed.split(",")),
    }


_SAYS = {
    "off": "the plugin installs nothing",
    "install": "the plugin installs kvqueue",
    "stay_off": "the plugin leaves kvqueue off, with a WARNING in vLLM's log",
    "refuse": "the plugin stops vLLM from starting",
}


def _print(facts: dict[str, Any], problems: list[str]) -> None:
    print(f"kvqueue {facts['kvqueue']} ({facts['location']}), Python {facts['python']}")
    print(f"import kvqueue loads: {facts['implementation']} twin ({facts['why']})")
    print("environment:")
    for name in _env.USER:
        value = facts["environment"][name]
        setting = f"{name}={value!r}" if value is not None else f"{name} unset"
        print(f"  {setting:<28} {_env.MEANINGS[name]}")
    lines = facts["accepted_vllm_lines"]
    print(f"accepted vLLM lines: {lines[0]} to {lines[-1]} (newest patch of each proven)")
    vllm = facts["vllm"]
    if not vllm["installed"]:
        print("vLLM: not installed")
    else:
        print(f"vLLM {vllm['version'] or '(no distribution metadata)'}: {vllm['verdict']}")
        print(
            f"vLLM: plugin entry point {'registered' if vllm['plugin_registered'] else 'missing'}"
            f"; VLLM_PLUGINS={vllm['VLLM_PLUGINS']!r}: vLLM "
            + ("calls" if vllm["plugin_loaded_by_vllm"] else "does not call")
            + " kvqueue's plugin"
        )
    plan = facts["plugin"]
    print(f"{_SAYS[plan['action']]}: {plan['reason']}")
    settings = plan["settings"]
    if plan["action"] == "install" and settings is not None:
        twin = settings["implementation"]
        policy = settings["on_misuse"] or f"{facts['environment'][_env.MISUSE_POLICY] or 'raise'}"
        print(
            f"  {kvqueue.IMPLEMENTATION if twin == 'auto' else twin} twin, on_misuse={policy}, "
            f"pool guard {'on' if settings['pool_guard'] else 'off'}"
            + (", over others' patches" if settings["wrap_foreign"] else "")
        )
    for problem in problems:
        print(f"problem: {problem}")


def main(argv: list[str] | None = None) -> int:
    # The first line, without its reST markup: argparse prints it as it is.
    summary = __doc__.split("\n")[0].replace("``", "")
    parser = argparse.ArgumentParser(prog="python -m kvqueue", description=summary)
    parser.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    args = parser.parse_args(argv)
    facts, problems = report()
    # A value that is not valid text (KVQUEUE_VLLM=$'\xff') must not stop the report.
    sys.stdout.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    if args.json:
        json.dump({**facts, "problems": problems}, sys.stdout, indent=1)
        print()
    else:
        _print(facts, problems)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
