"""The misuse policy, shared by both twins and the pool guard: raise, or repair.

``"raise"`` (the default) refuses a misused call whole and leaves the queue as
it was. ``"repair"`` applies the one safe repair that some misuses have (skip
a block that is linked already, a duplicate, a sentinel; ignore the removal of
a block that is not in the queue), links the rest of the call, counts the
repair on the queue and logs it (``_log``).
"""

from __future__ import annotations

from typing import Literal

from . import _env

__all__ = ("ENV", "MisusePolicy", "resolve")

MisusePolicy = Literal["raise", "repair"]

#: The environment variable read when a queue is built with ``on_misuse=None``
#: (kvqueue.vllm reads it by this name).
ENV = _env.MISUSE_POLICY

_POLICIES: dict[str, MisusePolicy] = {"raise": "raise", "repair": "repair"}


def resolve(on_misuse: object) -> MisusePolicy:
    """The policy that ``on_misuse`` names; ``None`` reads :data:`ENV` now.

    Raises ValueError for anything but ``"raise"``, ``"repair"`` or None (an
    unset or empty variable means ``"raise"``).
    """
    if on_misuse is None:
        return _env.choice(ENV, _POLICIES, "raise")
    if on_misuse == "raise" and type(on_misuse) is str:
        return "raise"
    if on_misuse == "repair" and type(on_misuse) is str:
        return "repair"
    raise ValueError(f"on_misuse must be 'raise', 'repair' or None, not {on_misuse!r:.80}")
