"""The vLLM release lines kvqueue accepts, and what each one has: the one table of them.

Each row was read from that line's released wheel (``vllm/v1/core/kv_cache_utils.py`` and
``block_pool.py``) and is proven by that release's own suites (``vllm_tests/``). The checks of
``kvqueue.vllm``, the pool guard, ``python -m kvqueue``, the tests and CI all read this table;
nothing else names a vLLM version.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from .. import _errors
from . import _registry

__all__ = (
    "LINES",
    "OLDER",
    "Line",
    "accepted",
    "find",
    "line_of",
    "mismatch",
    "parse",
    "verdict",
)

_FIELDS_018 = (
    "block_id",
    "ref_cnt",
    "_block_hash",
    "prev_free_block",
    "next_free_block",
    "is_null",
)
_FIELDS_024 = (*_FIELDS_018[:3], "_block_hash_num_tokens", *_FIELDS_018[3:])
_FIELDS_030 = (*_FIELDS_024[:2], "pool", *_FIELDS_024[2:])
# 0.34: the hash fields are public (their read-only properties gone).
_FIELDS_034 = tuple(name.lstrip("_") for name in _FIELDS_030)

# Before 0.23 vLLM's queue has no front insertion: its pools only append. kvqueue's queue
# keeps prepend_n on every line; a pool of such a line never calls it.
_QUEUE_018 = frozenset(
    ("popleft", "popleft_n", "remove", "append", "append_n", "get_all_free_blocks")
)
_QUEUE_023 = _QUEUE_018 | {"prepend_n"}
_QUEUE_026 = _QUEUE_023 | {"iter_blocks_after"}

# The guarded BlockPool methods each line defines, with their parameters after ``self``.
# Only 0.23's free_blocks takes ``prepend``: the lines before it had no front insertion.
_POOL_018: dict[str, tuple[str, ...]] = {
    "get_new_blocks": ("num_blocks",),
    "touch": ("blocks",),
    "free_blocks": ("ordered_blocks",),
}
_POOL_023 = {**_POOL_018, "free_blocks": ("ordered_blocks", "prepend")}
_POOL_030 = {**_POOL_018, "unpin_blocks": ("blocks", "on_reuse")}
_POOL_034 = {**_POOL_030, "free_blocks": ("ordered_blocks", "evict_first")}


def parse(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string (``0.31.0``, ``0.33.0+cpu``, ``0.30.1rc1``)."""
    parts = version.split(".")
    if len(parts) < 2 or not parts[0].isdigit():
        return None
    digits = ""
    for char in parts[1]:
        if not char.isdigit():
            break
        digits += char
    return (int(parts[0]), int(digits)) if digits else None


@dataclasses.dataclass(frozen=True)
class Line:
    """One minor line of vLLM: the newest patch release proven, and what the line has."""

    #: The newest patch release of the line that vLLM's index has; the one tested.
    release: str
    #: ``dataclasses.fields(KVCacheBlock)``, in order (every line: ``slots=True``).
    block_fields: tuple[str, ...]
    #: The public methods of vLLM's ``FreeKVCacheBlockQueue``.
    queue_methods: frozenset[str]
    #: The guarded ``BlockPool`` methods the line defines, each with its parameter names.
    pool_methods: dict[str, tuple[str, ...]]
    #: ``free_blocks`` decrements every occurrence before it queues any (0.18-0.23): a block
    #: listed twice is queued twice; later lines classify each block inside the loop.
    counts_first: bool
    #: ``free_blocks`` and ``touch`` skip null blocks before touching ``ref_cnt`` (0.33+).
    skips_null: bool
    #: A block's ``pool`` is a weak reference, its pool's ``_weak_self`` (0.34+):
    #: ``free_blocks`` hands a block of another live pool to it, and skips one whose
    #: pool is gone.
    weak_pool: bool
    #: The torch release the line's wheel pins (the CPU build used here may differ).
    torch: str

    @property
    def minor(self) -> tuple[int, int]:
        major, minor, *_ = self.release.split(".")
        return int(major), int(minor)

    @property
    def name(self) -> str:
        return "{}.{}".format(*self.minor)

    @property
    def has_pool_field(self) -> bool:
        """Blocks name their pool (0.30+); before, every block a pool frees is its own."""
        return "pool" in self.block_fields

    def pool_ref(self, pool: Any) -> Any:
        """What ``pool``'s own blocks hold in their ``pool`` field, the value vLLM's
        ``free_blocks`` compares with: the pool's ``_weak_self`` (0.34+), the pool itself
        (0.30-0.33), or None where blocks name no pool (before 0.30)."""
        if not self.has_pool_field:
            return None
        return pool._weak_self if self.weak_pool else pool


def _line(
    release: str,
    fields: tuple[str, ...],
    queue: frozenset[str],
    pool: dict[str, tuple[str, ...]],
    torch: str,
) -> Line:
    minor = parse(release)
    assert minor is not None
    return Line(
        release, fields, queue, pool, minor <= (0, 23), minor >= (0, 33), minor >= (0, 34), torch
    )


LINES: tuple[Line, ...] = (
    _line("0.18.1", _FIELDS_018, _QUEUE_018, _POOL_018, "2.10"),
    _line("0.19.1", _FIELDS_018, _QUEUE_018, _POOL_018, "2.10"),
    _line("0.20.2", _FIELDS_018, _QUEUE_018, _POOL_018, "2.11"),
    _line("0.21.0", _FIELDS_018, _QUEUE_018, _POOL_018, "2.11"),
    _line("0.22.1", _FIELDS_018, _QUEUE_018, _POOL_018, "2.11"),
    _line("0.23.0", _FIELDS_018, _QUEUE_023, _POOL_023, "2.11"),
    _line("0.24.0", _FIELDS_024, _QUEUE_023, _POOL_018, "2.11"),
    _line("0.25.1", _FIELDS_024, _QUEUE_023, _POOL_018, "2.11"),
    _line("0.26.0", _FIELDS_024, _QUEUE_026, _POOL_018, "2.11"),
    _line("0.27.1", _FIELDS_024, _QUEUE_026, _POOL_018, "2.13"),
    _line("0.28.0", _FIELDS_024, _QUEUE_026, _POOL_018, "2.13"),
    _line("0.29.0", _FIELDS_024, _QUEUE_026, _POOL_018, "2.13"),
    _line("0.30.0", _FIELDS_030, _QUEUE_026, _POOL_030, "2.13"),
    _line("0.31.0", _FIELDS_030, _QUEUE_026, _POOL_030, "2.13"),
    _line("0.32.0", _FIELDS_030, _QUEUE_026, _POOL_030, "2.13"),
    _line("0.33.0", _FIELDS_030, _QUEUE_026, _POOL_030, "2.14"),
    _line("0.34.0", _FIELDS_034, _QUEUE_026, _POOL_034, "2.14"),
)


#: Why a line older than every row is refused, as 0.17.1's wheel says (make vllm-line-check).
OLDER = (
    f"vLLM before {LINES[0].name} has no slotted KVCacheBlock (0.17's is a dataclass without "
    "slots), and kvqueue's queue links only blocks whose links are slots"
)


def accepted() -> str:
    """The accepted lines for a message, oldest first: ``0.18, 0.19, ...``."""
    return ", ".join(line.name for line in LINES)


def verdict(version: str | None) -> str:
    """What the table says of vLLM ``version``, in words (before any layout check)."""
    line = find(version) if version is not None else None
    if line is not None:
        return f"accepted: line {line.name}, proven at {line.release}"
    minor = parse(version) if version is not None else None
    if minor is None:
        return "not accepted: no version kvqueue can read"
    if minor > LINES[-1].minor:
        return f"not accepted yet: {_newer(version or '')}"
    older = f" ({OLDER})" if minor < LINES[0].minor else ""
    return f"not accepted: kvqueue accepts {LINES[0].name} to {LINES[-1].name}{older}"


def _newer(version: str) -> str:
    """What to do about a vLLM newer than every accepted line."""
    newest = LINES[-1]
    minor = "{}.{}".format(*(parse(version) or newest.minor))
    return (
        f"vLLM {version} is newer than the newest line kvqueue accepts ({newest.name}, "
        f"proven at {newest.release}); a kvqueue that accepts it lists {minor} among the "
        "accepted lines of `python -m kvqueue`, and in a kvqueue checkout "
        f"`make vllm-line-check VLLM={version}` checks it"
    )


def find(version: str) -> Line | None:
    """The accepted line of ``version``, or None."""
    minor = parse(version)
    return next((line for line in LINES if line.minor == minor), None)


def mismatch(line: Line, block_class: type, queue_class: type, pool_class: type) -> str | None:
    """How vLLM's own classes differ from ``line``'s row, or None when they match.

    Reads the classes' definitions only: dataclass fields, the queue's public methods and
    the guarded pool methods' parameter names, where the method is vLLM's own
    (``inspect.signature``, which follows the ``__wrapped__`` of kvqueue's own guard).
    """
    if not dataclasses.is_dataclass(block_class):
        return f"KVCacheBlock is not a dataclass: {block_class!r}"
    fields = tuple(f.name for f in dataclasses.fields(block_class))
    if fields != line.block_fields:
        return f"KVCacheBlock has fields {fields}, vLLM {line.name}'s are {line.block_fields}"
    methods = {name for name in vars(queue_class) if not name.startswith("_")}
    methods = {name for name in methods if callable(getattr(queue_class, name))}
    if methods != line.queue_methods:
        return (
            f"FreeKVCacheBlockQueue has methods {sorted(methods)}, "
            f"vLLM {line.name}'s are {sorted(line.queue_methods)}"
        )
    for name in _registry.GUARDED:
        expected = line.pool_methods.get(name)
        found: Any = inspect.getattr_static(pool_class, name, None)
        if (found is None) != (expected is None):
            has = "has" if found is not None else "lacks"
            return f"BlockPool {has} {name}(), unlike vLLM {line.name}"
        # Another project's patch has its own parameters: whether kvqueue may wrap it is
        # the foreign-patch check's to say (kvqueue.vllm), not the line's.
        if found is None or getattr(found, "__module__", None) != pool_class.__module__:
            continue
        try:
            params = tuple(inspect.signature(found).parameters)[1:]
        except (TypeError, ValueError):
            return f"BlockPool.{name} has no signature to read"
        if params != expected:
            return f"BlockPool.{name}{params} differs from vLLM {line.name}'s {expected}"
    return None


def line_of(
    version: str | None,
    block_class: Any,
    queue_class: type,
    pool_class: type,
    *,
    check_version: bool = True,
) -> Line:
    """The line of the installed vLLM, its classes checked against that line's row.

    ``check_version=False`` takes the first line whose row the classes match, whatever
    the version says. Raises :class:`~kvqueue._errors.VLLMLayoutError` naming the accepted lines.
    """
    line = find(version) if version is not None else None
    if line is not None:
        problem = mismatch(line, block_class, queue_class, pool_class)
        if problem is None:
            return line
        if check_version:
            raise _errors.not_this_line(version, line.name, problem)
    elif check_version:
        seen = "an unknown version" if version is None else f"vLLM {version}"
        minor = parse(version) if version is not None else None
        why = ""
        if version and minor and minor > LINES[-1].minor:
            why = f": {_newer(version)}"
        elif minor is not None and minor < LINES[0].minor:
            why = f" ({OLDER})"
        raise _errors.not_accepted(accepted(), seen, why)
    for candidate in reversed(LINES):
        if mismatch(candidate, block_class, queue_class, pool_class) is None:
            return candidate
    problem = mismatch(LINES[-1], block_class, queue_class, pool_class)
    raise _errors.no_line_has(version, problem)
