"""How kvqueue says what went wrong: every exception and message both twins, the pool
guard, the holder audit and the vLLM checks raise.

The messages of the errors vLLM raises are vLLM's, word for word: engines and
their tests match on them. kvqueue's own come in lines of at most 100 columns as a traceback
prints them (``_render.wrap``, as the log's records): the guard's and the audit's end with the
pool and the caller on a line of their own. Objects appear in them as ``_render`` gives them,
without running their code; the misuses repaired under ``"repair"`` are named in ``_policy``.
"""

from __future__ import annotations

from typing import TypeVar

from ._block import is_subtype, layout_change
from ._policy import QueueMisuse
from ._render import describe, number, one_line, plural, times, type_name, vllm_repr, wrap

_E = TypeVar("_E", bound=BaseException)


def _said(cls: type[_E], text: str) -> _E:
    """``cls(text)``, ``text`` in lines that fit as a traceback prints them: the first after
    the type's name (``ValueError: ``, ``kvqueue._errors.HolderAuditError: ``). O(len(text))."""
    module = cls.__module__
    shown = cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"
    return cls(wrap(text, len(shown) + len(": ")))


class HolderAuditError(RuntimeError):
    """The holder audit found a block that a live request lists in the free list, or
    listed more times than it is held, before a scheduler step handed anything out."""


class VLLMLayoutError(RuntimeError):
    """The installed vLLM is not one kvqueue knows how to patch; nothing was changed."""


class SettingError(SystemExit, ValueError):
    """A value a kvqueue variable does not take, met by vLLM's plugin (made by
    :func:`bad_settings`). Code that catches a ValueError catches it, its message in lines
    that fit as a traceback prints them; uncaught (vLLM's plugin loader lets it through), it
    ends the process as a SystemExit does: ``kvqueue: <the problem>`` (``code``, in lines
    that fit) on stderr, exit status 1, and no traceback through vLLM's code."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.code = wrap(f"kvqueue: {one_line(problem)}")


def bad_settings(problem: str) -> SettingError:
    """The plugin's refusal of the variables' values that ``problem`` names. O(len(problem))."""
    return _said(SettingError, problem)


def bad_value(problem: str) -> ValueError:
    """A variable's value refused (``_env.choice``), as a caller's traceback prints it."""
    return _said(ValueError, problem)


# The pool guard's and the holder audit's messages. ``call``, ``block`` and ``where`` come
# rendered (``_report.call``, ``named``, ``where``): the method called, the block, and the
# pool with the caller's frame, which each message puts on a line of its own.


def double_free(
    call: str, block: str, given: int, refs: int, in_list: bool, where: str
) -> ValueError:
    if in_list:
        what = f"which is in the free list already (ref_cnt {number(refs)})"
    else:
        what = f"while it holds {plural(refs, 'reference')}"
    return _in_pool(
        ValueError,
        f"{call} was given block {block} {times(given)} {what}: a double free; nothing was freed.",
        where,
    )


def stray_block(call: str, block: str, whose: str, refs: int, given: int, where: str) -> ValueError:
    return _in_pool(
        ValueError,
        f"{call} was given block {block}, a block of {whose}, which it would free into this "
        f"pool's queue (ref_cnt {number(refs)}, given {times(given)}); that queue takes only "
        "this pool's blocks: nothing was freed.",
        where,
    )


def ref_not_an_integer(call: str, block: str, value: object, where: str) -> TypeError:
    return _in_pool(
        TypeError,
        f"{call} was given block {block} whose ref_cnt is {describe(value)}, not an integer; "
        "nothing was changed.",
        where,
    )


def touch_negative(call: str, block: str, refs: int, where: str) -> ValueError:
    return _in_pool(
        ValueError,
        f"{call} was given block {block} whose ref_cnt is {number(refs)}: it was freed more "
        "times than it was referenced (a double free), and a touch would count it free and "
        "held at once; nothing was touched.",
        where,
    )


def held_handed_out(call: str, block: str, refs: int, where: str) -> ValueError:
    return _in_pool(
        ValueError,
        f"{call} would hand out block {block}, which is in the free list with ref_cnt "
        f"{number(refs)} (0 for a free block): a double free made it both free and held; "
        "nothing was allocated.",
        where,
    )


def held_stuck(call: str, block: str, refs: int, where: str) -> RuntimeError:
    return _in_pool(
        RuntimeError,
        f"{call}: held block {block} (ref_cnt {number(refs)}) is in the free list, and the "
        "queue cannot unlink it: were its pool or links assigned outside the queue? Nothing "
        "was allocated.",
        where,
    )


def audit_bad_count(block: str, value: object, where: str) -> TypeError:
    return _in_pool(
        TypeError,
        f"kvqueue's holder audit: block {block} has a ref_cnt of {describe(value)}, not an "
        "integer; nothing was changed.",
        where,
    )


def audit_finding(block: str, what: str, released: str, where: str) -> HolderAuditError:
    return _in_pool(
        HolderAuditError,
        f"kvqueue's holder audit, before the scheduler step: block {block} {what}; a second "
        f"request could be handed it. {released}Nothing was changed.",
        where,
    )


def listed_handed_out(
    call: str, block: str, what: str, released: str, where: str
) -> HolderAuditError:
    return _in_pool(
        HolderAuditError,
        f"{call} would hand out block {block}, which {what}: a second request would hold "
        f"it; nothing was allocated. {released}",
        where,
    )


def listed_touched(call: str, block: str, what: str, released: str, where: str) -> HolderAuditError:
    return _in_pool(
        HolderAuditError,
        f"{call} would give block {block}, which {what}, to a prefix hit: a second request "
        f"would hold it; nothing was touched. {released}",
        where,
    )


def queued_held(call: str, block: str, what: str, where: str) -> HolderAuditError:
    return _in_pool(
        HolderAuditError,
        f"{call} would queue block {block} free, which {what}: the next allocation would hand "
        "it to a second holder; nothing was queued.",
        where,
    )


def released_listed(call: str, block: str, what: str, where: str) -> HolderAuditError:
    return _in_pool(
        HolderAuditError,
        f"{call} would release block {block}, which {what}: it would be left fewer references "
        "than holders, and once free handed to a second holder; nothing was released.",
        where,
    )


def _in_pool(cls: type[_E], said: str, where: str) -> _E:
    """What the guard or the audit raises: ``said``, then the pool and the caller on a line
    of their own, where an operator's eye finds them."""
    return _said(cls, f"{said.rstrip()}\n{where}")


# kvqueue.vllm's refusals of a vLLM it cannot patch.


def foreign_patch(patch: str, wrapped: str) -> VLLMLayoutError:
    """kvqueue's refusal to install over ``patch`` (``wrapped``: what wrap_foreign does)."""
    return _said(
        VLLMLayoutError,
        f"{patch}; kvqueue would bypass that patch. install(wrap_foreign=True) "
        f"(KVQUEUE_WRAP_FOREIGN=1) {wrapped}",
    )


def not_this_line(version: str | None, line: str, problem: str) -> VLLMLayoutError:
    return _said(
        VLLMLayoutError, f"vLLM {version} is not what kvqueue knows of vLLM {line}: {problem}"
    )


def not_accepted(accepted: str, seen: str, why: str) -> VLLMLayoutError:
    return _said(
        VLLMLayoutError,
        f"kvqueue accepts the vLLM lines whose own suites pass with it ({accepted}), not "
        f"{seen}{why}; install(check_version=False) tries the line whose layout this vLLM has",
    )


def no_line_has(version: str | None, problem: str | None) -> VLLMLayoutError:
    return _said(VLLMLayoutError, f"vLLM {version} has the layout of no accepted line ({problem})")


def empty() -> ValueError:
    return ValueError("No free blocks available")


def out_of_sync(num_free_blocks: int) -> AssertionError:
    return AssertionError(
        f"num_free_blocks ({number(num_free_blocks)}) is out of sync with the free list."
    )


def invalid_next(method: str) -> RuntimeError:
    return RuntimeError(
        f"Invalid block found in {method}() which doesn't have a valid next_free_block"
    )


# A lost end of the list. vLLM's append() raises TAIL_LOST as a RuntimeError, while its
# append_n() and prepend_n() assert (AssertionError): both twins keep vLLM's two types.
TAIL_LOST = "prev_free_block of fake_free_list_tail should always exist"
HEAD_LOST = "next_free_block of fake_free_list_head should always exist"


def too_many(n: int, num_free_blocks: int) -> AssertionError:
    return _said(
        AssertionError,
        f"popleft_n({number(n)}) asked for more blocks than the {number(num_free_blocks)} "
        "free ones",
    )


def negative(n: int) -> ValueError:
    return ValueError(f"popleft_n() needs n >= 0, got {number(n)}")


def compiled_missing(why: object) -> ImportError:
    """The compiled twin, asked for by name, could not be imported (``why``)."""
    return _said(
        ImportError,
        f"kvqueue's compiled queue is not available ({why}); "
        "use install('python') or install('auto')",
    )


def not_a_first_block(block_type: type, why: TypeError) -> TypeError:
    return _said(
        TypeError,
        f"FreeKVCacheBlockQueue(): blocks[0] has type {type_name(block_type)}, which the queue "
        f"cannot thread: {why}",
    )


def not_a_block(obj: object, block_type: type, where: str) -> TypeError:
    why = ""
    if is_subtype(type(obj), block_type):
        changed = layout_change(type(obj), block_type)
        why = (
            f", whose class redefines {changed} (the queue reads and writes "
            f"{type_name(block_type)}'s own)"
        )
    return _said(
        TypeError, f"{where}: expected a {type_name(block_type)}, got {describe(obj)}{why}"
    )


def corrupted(method: str, obj: object) -> RuntimeError:
    return _said(
        RuntimeError,
        f"{method}(): the free list is corrupted (a link holds {describe(obj)}); were "
        "prev_free_block/next_free_block assigned outside the queue?",
    )


# What a batch's misuse raises under "raise".
_LINK_MISUSES = {
    "sentinel": "is a sentinel of this queue",
    "duplicate": "appears more than once in the batch",
    "linked": "is already linked into a free list",
}


def misuse(method: str, kind: QueueMisuse, block: object) -> Exception:
    """What a misuse of ``kind`` raises under ``"raise"``. The one vLLM raises too,
    ``remove()`` of a block that is not linked, names a block of vLLM's class or
    kvqueue's as vLLM does."""
    described = (vllm_repr(block) if kind == "not_linked" else None) or describe(block)
    if kind == "not_linked":
        return RuntimeError(f"remove() called on an invalid block: {described}")
    if kind == "other_pool":
        said = f"{method}() called on a block of another pool's queue: {described}"
    else:
        said = f"{method}() called on a block that {_LINK_MISUSES[kind]}: {described}"
    return _said(ValueError, said)


def too_long(num_free_blocks: int) -> RuntimeError:
    return _said(
        RuntimeError,
        f"the free list holds more than num_free_blocks ({number(num_free_blocks)}) blocks: "
        "it is corrupted (a cycle or a block of another queue)",
    )


def not_iterable(method: str) -> TypeError:
    return TypeError(f"{method}() needs an iterable of blocks")


def count_not_an_integer(value: object) -> TypeError:
    return TypeError(f"num_free_blocks must be an integer, not {type_name(type(value))}")


def count_out_of_range(num: int) -> ValueError:
    return ValueError(f"num_free_blocks must be from 0 to sys.maxsize, not {number(num)}")


def len_overflow() -> OverflowError:
    return OverflowError("cannot fit 'int' into an index-sized integer")


COUNT_UNDELETABLE = "num_free_blocks cannot be deleted"

# Raised as a TypeError (both twins), so wrapped after "TypeError: ".
UNCOPYABLE = wrap(
    "FreeKVCacheBlockQueue cannot be copied or pickled: it is threaded through its "
    "blocks' own links, which a copy would share; build a new queue from new blocks",
    len("TypeError: "),
)

# Raised as a TypeError by both twins' door (kvqueue.vllm's screens).
DOOR_UNCOPYABLE = wrap(
    "a free list's door cannot be copied or pickled: it is one pool's, and counts that pool's "
    "frees under way",
    len("TypeError: "),
)

INITIALIZED = "the queue is already initialized"
BUILDING = "the queue is being initialized: __init__ cannot be called again from inside it"
UNINITIALIZED = "the queue is not initialized"
