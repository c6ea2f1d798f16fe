"""The misuse policy, shared by both twins and the pool guard: raise, or repair.

``"raise"`` (the default) refuses a misused call whole and leaves the queue as
it was. ``"repair"`` applies the one safe repair that some misuses have (skip
a block that is linked already, a duplicate, a sentinel; ignore the removal of
a block that is not in the queue), links the rest of the call, counts the
repair on the queue and logs it (``_log``). The misuses each repairs are named
here too, with what the repair did.
"""

from __future__ import annotations

from typing import Literal, get_args

from . import _env

__all__ = (
    "AUDIT_MISUSES",
    "ENV",
    "POOL_MISUSES",
    "QUEUE_MISUSES",
    "QUEUE_REPAIRS",
    "REPAIRED",
    "AuditMisuse",
    "MisusePolicy",
    "PoolMisuse",
    "QueueMisuse",
    "resolve",
)

MisusePolicy = Literal["raise", "repair"]

#: The environment variable read when a queue is built with ``on_misuse=None``
#: (kvqueue.vllm reads it by this name).
ENV = _env.MISUSE_POLICY

#: The misuses a queue repairs under ``"repair"`` (and refuses under ``"raise"``).
QueueMisuse = Literal["duplicate", "linked", "sentinel", "not_linked", "other_pool"]
#: What the holder audit finds at a scheduler step (and repairs under ``"repair"``): a
#: block a live request lists that is in the free list; one listed twice by one request
#: in one manager; one listed by two managers; one listed more times than its ``ref_cnt``.
AuditMisuse = Literal["listed_free", "listed_twice", "two_managers", "under_counted"]
#: The misuses the pool guard repairs, the holder audit's included.
PoolMisuse = Literal[
    "double_free",
    "negative_ref",
    "held_free",
    "listed_free",
    "listed_twice",
    "two_managers",
    "under_counted",
]
QUEUE_MISUSES: tuple[QueueMisuse, ...] = get_args(QueueMisuse)
#: The queue's methods that repair a misuse, with what each can repair (the constructor by its
#: class's name, as its messages say it; its queue has no sentinel and no pool before it links).
QUEUE_REPAIRS: dict[str, tuple[QueueMisuse, ...]] = {
    "FreeKVCacheBlockQueue": ("duplicate", "linked"),
    "append": ("linked", "sentinel", "other_pool"),
    "append_n": ("duplicate", "linked", "sentinel", "other_pool"),
    "prepend_n": ("duplicate", "linked", "sentinel", "other_pool"),
    "remove": ("not_linked", "other_pool"),
}
POOL_MISUSES: tuple[PoolMisuse, ...] = get_args(PoolMisuse)
AUDIT_MISUSES: tuple[AuditMisuse, ...] = get_args(AuditMisuse)

#: What the repair of each misuse did (its log line says it).
REPAIRED: dict[QueueMisuse | PoolMisuse, str] = {
    "duplicate": "it appears more than once in the batch; linked once",
    "linked": "it is already linked into a free list; left where it is",
    "sentinel": "it is a sentinel of this queue; left where it is",
    "not_linked": "it is not linked; nothing removed",
    "other_pool": "it belongs to another pool's queue; left where it is",
    "double_free": "it was given more times than it holds references; the excess dropped",
    "negative_ref": "its ref_cnt was negative (an unguarded double free); taken as 0",
    "held_free": "it was in the free list while held; unlinked instead of handed out",
    "listed_free": "a live request lists it, but it was in the free list",
    "listed_twice": "one request lists it twice in one manager",
    "two_managers": "two managers list it",
    "under_counted": "it is listed more times than its ref_cnt",
}


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
    # At most 100 columns after "ValueError: ", as a traceback prints it.
    raise ValueError(f"on_misuse must be 'raise', 'repair' or None, not {on_misuse!r:.38}")
