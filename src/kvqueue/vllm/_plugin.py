"""vLLM's plugin (``vllm.general_plugins``): what the environment asks of kvqueue, decided once.

:func:`plan` reads every variable and checks the installed vLLM, changing nothing;
:func:`plugin` carries that plan out, and ``python -m kvqueue`` prints it, so the two agree.
"""

from __future__ import annotations

import dataclasses
import os
from importlib import metadata
from typing import Any, Literal

from .. import _env, _errors, _log, _policy, _render
from . import _metrics

__all__ = ("Plan", "plan", "plugin")

#: ``KVQUEUE_VLLM``'s values: the twin, and whether a vLLM kvqueue refuses stops vLLM
#: (strict) or leaves kvqueue off with a warning (``auto``).
_CHOICES: dict[str, tuple[str, bool] | None] = {
    "0": None,
    "1": ("auto", True),
    "cython": ("cython", True),
    "python": ("python", True),
    "auto": ("auto", False),
}

Action = Literal["off", "install", "stay_off", "refuse"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What :func:`plugin` does in this environment.

    ``action``: ``"off"`` (``KVQUEUE_VLLM`` unset or 0: nothing, vLLM not even imported),
    ``"install"`` (``install(**settings)``), ``"stay_off"`` (``KVQUEUE_VLLM=auto`` on a vLLM
    kvqueue does not accept: one WARNING in vLLM's log, vLLM untouched) or ``"refuse"``
    (the plugin raises ``error``, and vLLM does not start). ``reason`` says why, in one line
    (``error``'s message, wrapped for a traceback, as one).
    """

    action: Action
    reason: str
    settings: dict[str, Any] | None = None
    error: Exception | None = None
    #: Every variable's bad value, each said in one line, whatever the action (an off plugin
    #: reads none of them).
    problems: tuple[str, ...] = ()


def plan() -> Plan:
    """What the plugin would do now: every variable read, vLLM checked, nothing changed."""
    found: list[str] = []
    asked = _read(lambda: _env.choice(_env.VLLM, _CHOICES, None), found)
    vllm_value_bad = bool(found)
    policy = _read(lambda: _policy.resolve(None), found)
    guard = _read(lambda: _env.flag(_env.POOL_GUARD, default=True), found)
    every = _read(_env.audit_every, found)
    wrap = _read(lambda: _env.flag(_env.WRAP_FOREIGN), found)
    # Read by import kvqueue, which vLLM's loader lets pass a bad value to this plan.
    _read(lambda: _env.flag(_env.PURE), found)
    problems = tuple(found)
    if asked is None and not vllm_value_bad:
        return Plan("off", f"{_env.VLLM} unset or 0", problems=problems)
    if problems:
        why = "; ".join(problems)
        return Plan("refuse", why, error=_errors.bad_settings(why), problems=problems)
    from .. import vllm

    implementation, strict = asked
    state = vllm.status()
    settings = {
        "implementation": implementation,
        # Unset, an application's own install() policy stays.
        "on_misuse": policy if os.environ.get(_env.MISUSE_POLICY) else state["on_misuse"],
        "pool_guard": guard,
        "wrap_foreign": wrap,
    }
    shown = {**settings, "audit_every": every}
    try:
        vllm.check(implementation, wrap_foreign=wrap)
    except (ImportError, _errors.VLLMLayoutError) as exc:
        return Plan("refuse" if strict else "stay_off", _render.one_line(exc), shown, exc)
    except (Exception, SystemExit) as exc:
        # vLLM's own import failed (a CUDA library missing, a sys.exit): in the plugin vLLM
        # is imported already, so only python -m kvqueue gets here.
        why = f"importing vLLM failed: {type(exc).__name__}: {_render.one_line(exc)}"
        return Plan("refuse" if strict else "stay_off", why, shown, ImportError(why))
    return Plan("install", f"{_env.VLLM}={os.environ[_env.VLLM]}", shown)


def _read(read: Any, problems: list[str]) -> Any:
    try:
        return read()
    except ValueError as exc:
        problems.append(_render.one_line(exc))
        return None


def plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: what :func:`plan` says.

    ``KVQUEUE_VLLM`` unset, empty or ``0``: nothing (not even an import of vLLM). ``1``,
    ``cython`` or ``python``: installs that twin (``1``: whichever ``import kvqueue`` picks),
    with the policy ``KVQUEUE_ON_MISUSE`` names, the pool guard unless
    ``KVQUEUE_POOL_GUARD=0``, over another project's patch if ``KVQUEUE_WRAP_FOREIGN=1``;
    on a vLLM kvqueue does not accept it raises, and vLLM does not start. ``auto``: the
    same, except that on such a vLLM it logs one WARNING line saying why kvqueue stays off
    and leaves vLLM untouched. Logs one line in vLLM's log when it activates; a repeated
    call with the same settings changes nothing.

    Raises :class:`~kvqueue._errors.SettingError` (a ValueError that, uncaught, ends vLLM's
    process with its message) for a value none of these variables takes, and, strict,
    whatever :func:`kvqueue.vllm.install` raises.
    """
    decided = plan()
    if decided.action == "off":
        return
    if decided.action == "refuse":
        assert decided.error is not None
        raise decided.error
    if decided.action == "stay_off":
        _stay_off(decided.reason)
        _metrics.start(_not_active(decided.reason))
        return
    from .. import vllm

    assert decided.settings is not None
    before = vllm.status()
    settings = {k: v for k, v in decided.settings.items() if k != "audit_every"}
    try:
        vllm.install(**settings)
    except (ImportError, _errors.VLLMLayoutError) as exc:
        # Only a vLLM changed between the check and now gets here.
        if os.environ.get(_env.VLLM) != "auto":
            raise
        _stay_off(str(exc))
        _metrics.start(_not_active(str(exc)))
        return
    after = vllm.status()
    _metrics.start(_active(after))
    if after != before:
        import kvqueue

        _log.logger.info(
            "kvqueue %s active on vLLM %s: vLLM's free block queue is kvqueue's %s twin, "
            "pool guard %s, holder audit %s, on_misuse=%s%s",
            kvqueue.__version__,
            after["line"],
            after["implementation"],
            "on (" + ", ".join(after["guarded"]) + ")" if after["pool_guard"] else "off",
            "on" if after["holder_audit"] else "off",
            after["on_misuse"] or _policy.resolve(None),
            "".join(f"; {name} BYPASSED: {why}" for name, why in after["bypassed"].items()),
        )


def _active(status: dict[str, Any]) -> _metrics.Facts:
    """What ``status()`` says is installed, for the metrics."""
    return _metrics.Facts(
        _vllm_version(),
        twin=status["implementation"],
        on_misuse=status["on_misuse"] or _policy.resolve(None),
        vllm_line=status["line"],
        guarded=tuple(status["guarded"]),
        holder_audit=status["holder_audit"],
        audit_every=status["audit_every"],
    )


def _not_active(reason: str) -> _metrics.Facts:
    return _metrics.Facts(_vllm_version(), reason=reason)


def _vllm_version() -> str:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:  # vLLM without its metadata: the line says which
        return ""


def _stay_off(reason: str) -> None:
    _log.forward_to_vllm(True)
    _log.logger.warning("kvqueue stays off (%s=auto): %s", _env.VLLM, reason)
