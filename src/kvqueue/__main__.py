"""``python -m kvqueue``: what kvqueue does in this environment, and why (for bug reports).

Prints the version, the twin ``import kvqueue`` loads and why, every environment variable
kvqueue reads, the installed vLLM's version and what the table of accepted lines says of it,
and what vLLM's plugin loader will make of them: the plan that kvqueue's plugin itself carries
out (``kvqueue.vllm._plugin.plan``). When the plugin is on, vLLM's other general plugins are run
first as vLLM runs them (those vLLM loads before kvqueue's before the plan, the others after
it), so that the plan sees what they patch. Exits 1 when the environment asks for what cannot
happen (a bad value, a vLLM kvqueue refuses under a strict KVQUEUE_VLLM, a plugin vLLM will not
call, a guard a later plugin would bypass); --json prints the same as one object.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import textwrap
from importlib import metadata
from typing import Any

import kvqueue

from . import _env, _render, _twin
from .vllm import _foreign, _lines, _metrics, _plugin, _registry


def report() -> tuple[dict[str, Any], list[str]]:
    """What ``python -m kvqueue`` says, and the problems that make it exit 1; each message
    (a reason, a problem) as one line, however its exception was wrapped for a traceback."""
    problems: list[str] = []
    vllm = _vllm()
    decided = _plugin.plan()
    called = decided.action != "off" and vllm.get("installed") and vllm["plugin_loaded_by_vllm"]
    before, after = _others(vllm) if called else ([], [])
    if before:
        problems += _run(before)
        decided = _plugin.plan()
    problems += decided.problems
    try:
        _env.flag(_env.PURE)
        implementation, why = kvqueue.IMPLEMENTATION, _twin.loaded().why
    except ValueError as exc:
        implementation, why = None, f"it raises: {exc}"
    settings = decided.settings
    if settings is not None and settings["implementation"] == "auto":
        settings = {**settings, "implementation": kvqueue.IMPLEMENTATION}
    facts: dict[str, Any] = {
        "kvqueue": kvqueue.__version__,
        "location": os.path.dirname(kvqueue.__file__),
        "python": sys.version.split()[0],
        "implementation": implementation,
        "why": _render.one_line(why),
        "environment": {name: os.environ.get(name) for name in _env.USER},
        "accepted_vllm_lines": [line.release for line in _lines.LINES],
        "checks": checks(),
    }
    facts["vllm"] = vllm
    reason = decided.reason
    if decided.action in ("refuse", "stay_off") and not vllm["installed"] and not decided.problems:
        # The plan's check imported vLLM and failed: there is no vLLM for the plugin to stop.
        reason = _NO_VLLM
    facts["plugin"] = {
        "action": decided.action,
        "reason": reason,
        "settings": settings,
        "called_by_vllm": bool(called),
    }
    if decided.action == "refuse" and not decided.problems:
        problems.append(reason)
    elif decided.action != "off" and vllm.get("installed") and not called:
        problems.append(
            f"{_env.VLLM}={os.environ.get(_env.VLLM)} but vLLM will not call kvqueue's plugin "
            + (
                "(VLLM_PLUGINS does not name kvqueue)"
                if vllm["plugin_registered"]
                else "(its entry point is missing)"
            )
        )
    if decided.action == "install" and after and settings and settings["pool_guard"]:
        problems += _bypassing(after)
    return facts, [_render.one_line(problem) for problem in problems]


def checks() -> dict[str, list[str]]:
    """Where the pool guard checks, with what each place refuses or repairs (the registry's)."""
    where = {f"BlockPool.{name}": kinds for name, kinds in _registry.GUARDED.items()}
    where |= {f"FreeKVCacheBlockQueue.{name}": kinds for name, kinds in _registry.ENTRY.items()}
    where[f"KVCacheManager.{_registry.AUDIT_HOOK}"] = _registry.KINDS[_registry.AUDIT_HOOK]
    return {place: list(kinds) for place, kinds in where.items()}


def _others(vllm: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """vLLM's other general plugins that it calls, in its order: before kvqueue's, after."""
    allowed = vllm["VLLM_PLUGINS"]
    before: list[Any] = []
    after: list[Any] = []
    for point in metadata.entry_points(group="vllm.general_plugins"):
        if point.name == "kvqueue":
            before, after = before + after, []
        elif allowed is None or point.name in allowed.split(","):
            after.append(point)
    return before, after


def _run(points: list[Any]) -> list[str]:
    """Call each plugin as vLLM would; what stops one is a problem."""
    return [problem for point in points if (problem := _call(point))]


def _call(point: Any) -> str | None:
    try:
        point.load()()
    except (Exception, SystemExit) as exc:
        return f"vLLM's plugin {point.name} raised {type(exc).__name__}: {exc}"
    return None


def _bypassing(points: list[Any]) -> list[str]:
    """The guarded methods that plugins vLLM calls after kvqueue's replace: bypassed."""
    try:
        pool_class = vars(importlib.import_module("vllm.v1.core.block_pool"))["BlockPool"]
    except (Exception, SystemExit):
        return []
    was = {name: vars(pool_class).get(name) for name in _registry.GUARDED}
    problems = _run(points)
    for name, method in was.items():
        now = vars(pool_class).get(name)
        if now is not method:
            problems.append(
                f"a plugin vLLM calls after kvqueue's replaces BlockPool.{name}, bypassing "
                f"kvqueue's guard ({_foreign.method_patch(pool_class, name, now)}); "
                f"{_env.WRAP_FOREIGN}=1 cannot help: the patch comes after the guard"
            )
    return problems


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
        "verdict": _lines.verdict(version),
        "VLLM_PLUGINS": allowed,
        "plugin_registered": bool(points),
        "plugin_loaded_by_vllm": bool(points)
        and (allowed is None or "kvqueue" in allowed.split(",")),
    }


# The widest line printed (a problem or a meaning longer than that is wrapped).
_WIDTH = 100

_NO_VLLM = (
    "no vLLM is installed in this environment, so nothing calls the plugin; install vLLM here "
    "and run python -m kvqueue again"
)

_SAYS = {
    "off": "the plugin installs nothing",
    "install": "the plugin installs kvqueue",
    "stay_off": "the plugin leaves kvqueue off, with a WARNING in vLLM's log",
    "refuse": "the plugin stops vLLM from starting",
}


def _say(text: str, first: str = "", more: str = "  ") -> None:
    """One paragraph (one line of :func:`report`'s) in lines of at most 100 columns."""
    print(
        textwrap.fill(
            text,
            _WIDTH,
            initial_indent=first,
            subsequent_indent=more,
            break_long_words=False,
            break_on_hyphens=False,
        )
    )


def _print(facts: dict[str, Any], problems: list[str]) -> None:
    _say(f"kvqueue {facts['kvqueue']} ({facts['location']}), Python {facts['python']}")
    if facts["implementation"] is None:
        loads = f"import kvqueue: {facts['why']}"
    else:
        loads = f"import kvqueue loads: {facts['implementation']} twin ({facts['why']})"
    _say(loads)
    print("environment (each vLLM process reads it as it starts, and keeps what it read):")
    for name in _env.USER:
        value = facts["environment"][name]
        setting = f"{name}={value!r}" if value is not None else f"{name} unset"
        meaning = textwrap.wrap(_env.MEANINGS[name], _WIDTH - 31)
        if len(setting) > 28:
            # A long value on lines of its own, its meaning below it in the meanings' column.
            print(textwrap.fill(setting, _WIDTH, initial_indent="  ", subsequent_indent="    "))
        else:
            print(f"  {setting:<28} {meaning.pop(0)}")
        for more in meaning:
            print(f"{'':<31}{more}")
    lines = facts["accepted_vllm_lines"]
    print(f"accepted vLLM lines: {lines[0]} to {lines[-1]} (newest patch of each proven)")
    vllm = facts["vllm"]
    if not vllm["installed"]:
        print("vLLM: not installed")
    else:
        _say(f"vLLM {vllm['version'] or '(no distribution metadata)'}: {vllm['verdict']}")
        allowed = vllm["VLLM_PLUGINS"]
        _say(
            f"vLLM: plugin entry point {'registered' if vllm['plugin_registered'] else 'missing'}"
            f"; {'VLLM_PLUGINS unset' if allowed is None else f'VLLM_PLUGINS={allowed!r}'}: "
            + ("vLLM calls" if vllm["plugin_loaded_by_vllm"] else "vLLM does not call")
            + " kvqueue's plugin"
        )
    plan = facts["plugin"]
    settings = plan["settings"]
    if plan["action"] != "off" and vllm["installed"] and not plan["called_by_vllm"]:
        print("the plugin is not called, so it installs nothing")
    elif plan["reason"] == _NO_VLLM:
        _say(f"the plugin: {_NO_VLLM}")
    else:
        said = f"{_SAYS[plan['action']]}: {plan['reason']}"
        _say(said)
    if plan["action"] == "install" and plan["called_by_vllm"] and settings is not None:
        policy = settings["on_misuse"] or f"{facts['environment'][_env.MISUSE_POLICY] or 'raise'}"
        _say(
            f"{settings['implementation']} twin, on_misuse={policy}, "
            f"pool guard {'on' if settings['pool_guard'] else 'off'}, holder audit "
            + (
                "each step"
                + (
                    f" (all listings every {settings['audit_every']})"
                    if settings["audit_every"]
                    else ""
                )
                + ", the free list's entry and exit checked against the holder index"
                if settings["pool_guard"]
                else "off"
            )
            + (", over others' patches" if settings["wrap_foreign"] else ""),
            first="  ",
            more="    ",
        )
    guarded = plan["action"] == "install" and plan["called_by_vllm"] and settings is not None
    if guarded and settings["pool_guard"]:
        print("  checked where (what each refuses or repairs; the queue's methods: called by")
        print("  anything but a guarded free; new_step_starts: the holder audit):")
        for place, kinds in facts["checks"].items():
            print(f"    {place:<38} {', '.join(kinds)}")
    if plan["action"] in ("install", "stay_off") and plan["called_by_vllm"]:
        said = "active)" if plan["action"] == "install" else "not active, and why)"
        names = ", ".join(f"{name}_total" for name in _metrics.COUNTERS)
        counters = f"counters: vllm serve's /metrics, per engine ({names}; {_metrics.INFO}: {said}"
        _say(counters, first="  ", more="    ")
    for problem in problems:
        _say(f"problem: {problem}")


def main(argv: list[str] | None = None) -> int:
    # The first line, without its reST markup: argparse prints it as it is.
    summary = __doc__.split("\n")[0].replace("``", "")
    parser = argparse.ArgumentParser(prog="python -m kvqueue", description=summary)
    parser.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    args = parser.parse_args(argv)
    facts, problems = report()
    # A value that is not valid text (KVQUEUE_VLLM=$'\xff') must not stop the report.
    sys.stdout.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    try:
        if args.json:
            json.dump({**facts, "problems": problems}, sys.stdout, indent=1)
            print()
        else:
            _print(facts, problems)
        sys.stdout.flush()
    except BrokenPipeError:
        # A reader that stopped early (python -m kvqueue | head): Python's own advice, so
        # that the flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
