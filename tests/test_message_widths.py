"""Every line of every message kvqueue raises, logs or prints fits in 100 columns, rendered
with values as long as a real deployment gives them: a block of a million-block pool, a pool
at a 64-bit address, a caller deep in an installed vLLM, a request's id, five holders.
An exception's first line is measured as a traceback prints it, after its type; a log
record's lines as kvqueue hands them to the handlers (a handler's format may put its own
prefix before each, as vLLM's does)."""

from __future__ import annotations

import contextlib
import functools
import logging
import traceback
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from kvqueue import KVCacheBlock, _env, _errors, _log, _policy, _render, _twin
from kvqueue.vllm import _audit, _lines, _plugin, _report

from support.helpers import one_line

WIDTH = 100
# A caller as _report names it: an installed vLLM's module, a high line, a long function.
CALLER = (
    "/opt/conda/envs/serving/lib/python3.11/site-packages/vllm/v1/core/"
    "single_type_kv_cache_manager.py"
)
REQUEST = "cmpl-0f3c9a7e5b2d4c18a6e9f0b1d2c3e4f5-0"
HOLDERS = [("FullAttentionManager", f"{REQUEST[:-1]}{n}") for n in range(5)]


class BlockPool:
    """A pool as the messages see it: its address and its size."""

    num_gpu_blocks = 1_048_576
    free_block_queue = None


def _from_vllm(pool: Any, read: Callable[[Any], str]) -> str:
    """``read(pool)`` called from code that sits where vLLM's caller would (file and line)."""
    source = "\n" * 1233 + "def remove_skipped_blocks(pool, read):\n    return read(pool)\n"
    scope: dict[str, Any] = {}
    exec(compile(source, CALLER, "exec"), scope)
    return str(scope["remove_skipped_blocks"](pool, read))


POOL = BlockPool()
WHERE = _from_vllm(POOL, _report.where)
BLOCK = _report.named(KVCacheBlock(1_048_575))
CALL = _report.call("get_new_blocks")
RELEASED = (
    "The last release of it no holder index checked was a free called from "
    f"{WHERE.partition('from ')[2]}. "
)


def _held(refs: int) -> KVCacheBlock:
    block = KVCacheBlock(1_048_575)
    block.ref_cnt = refs
    return block


WHAT = [_audit._what(kind, _held(3), HOLDERS) for kind in _policy.AUDIT_MISUSES]

# Every message of _errors that kvqueue words (vLLM's own, word for word, are vLLM's).
RAISED: dict[str, Callable[[], BaseException]] = {
    "double_free": lambda: _errors.double_free(CALL, BLOCK, 2, 1, False, WHERE),
    "double_free_listed": lambda: _errors.double_free(CALL, BLOCK, 2, 0, True, WHERE),
    "stray_block": lambda: _errors.stray_block(CALL, BLOCK, "another pool", 1, 2, WHERE),
    "ref_not_an_integer": lambda: _errors.ref_not_an_integer(CALL, BLOCK, "1", WHERE),
    "touch_negative": lambda: _errors.touch_negative(CALL, BLOCK, -1, WHERE),
    "held_handed_out": lambda: _errors.held_handed_out(CALL, BLOCK, 2, WHERE),
    "held_stuck": lambda: _errors.held_stuck(CALL, BLOCK, 2, WHERE),
    "audit_bad_count": lambda: _errors.audit_bad_count(BLOCK, 1.5, WHERE),
    **{
        f"audit_finding_{n}": functools.partial(_errors.audit_finding, BLOCK, what, RELEASED, WHERE)
        for n, what in enumerate(WHAT)
    },
    "listed_handed_out": lambda: _errors.listed_handed_out(CALL, BLOCK, WHAT[0], RELEASED, WHERE),
    "listed_touched": lambda: _errors.listed_touched(CALL, BLOCK, WHAT[0], RELEASED, WHERE),
    "queued_held": lambda: _errors.queued_held(CALL, BLOCK, WHAT[0], WHERE),
    "released_listed": lambda: _errors.released_listed(CALL, BLOCK, WHAT[0], WHERE),
    "foreign_patch": lambda: _errors.foreign_patch(
        "vllm.v1.core.block_pool.BlockPool.free_blocks is not vLLM's: it was replaced by "
        "vllm_ascend.patch.worker.patch_common.patch_block_pool.free_blocks",
        "wraps that patch: kvqueue's guard runs first, then the patch",
    ),
    "not_this_line": lambda: _errors.not_this_line(
        "0.33.0", "0.33", "BlockPool.free_blocks has a parameter kvqueue does not know"
    ),
    "not_accepted": lambda: _errors.not_accepted(_lines.accepted(), "vLLM 0.17.1", ""),
    "not_accepted_older": lambda: _errors.not_accepted(
        _lines.accepted(), "vLLM 0.17.1", f" ({_lines.OLDER})"
    ),
    "no_line_has": lambda: _errors.no_line_has("0.35.0rc1.dev12+g0123abcd", "a" * 60),
    "not_a_block": lambda: _errors.not_a_block(
        object(), KVCacheBlock, "FreeKVCacheBlockQueue.iter_blocks_after()"
    ),
    "corrupted": lambda: _errors.corrupted("iter_blocks_after", object()),
    **{
        f"misuse_{kind}": functools.partial(_errors.misuse, "prepend_n", kind, KVCacheBlock(7))
        for kind in _policy.QUEUE_MISUSES
        if kind != "not_linked"  # vLLM's message, with vLLM's repr of the block
    },
    "too_long": lambda: _errors.too_long(1_048_576),
    "too_many": lambda: _errors.too_many(1_048_577, 1_048_576),
    "uncopyable": lambda: TypeError(_errors.UNCOPYABLE),
    # A bad name given to install() or a queue, as long as a caller can make it.
    "bad_policy": lambda: _raised(_policy.resolve, "repair-" * 40),
    "bad_twin": lambda: _raised(_twin.named, "compiled-" * 40),
}


def _raised(call: Callable[[str], object], value: str) -> BaseException:
    with pytest.raises(ValueError, match="must be") as caught:
        call(value)
    return caught.value


def _too_wide(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > WIDTH]


@pytest.mark.parametrize("name", RAISED)
def test_each_exception_fits_as_a_traceback_prints_it(name: str) -> None:
    exc = RAISED[name]()
    shown = "".join(traceback.format_exception_only(type(exc), exc))
    assert not _too_wide(shown), shown


# The pool guard's and the holder audit's: each ends with the pool and the caller.
IN_POOL = [
    name
    for name in RAISED
    if name.split("_")[0]
    in {"double", "stray", "ref", "touch", "held", "audit", "listed", "queued", "released"}
]


def test_the_pool_and_the_caller_end_the_guards_and_the_audits_messages_on_their_own_line() -> None:
    assert len(IN_POOL) == 16
    for name in IN_POOL:
        said = str(RAISED[name]())
        pool = WHERE.partition("; ")[0]
        assert f"\n{pool}; " in said, said
        assert one_line(said).endswith(f". {WHERE}"), said


def test_a_message_wrapped_keeps_its_words() -> None:
    """Read as one line, a wrapped message is the text it was made from, word for word."""
    text = f"{CALL} was given block {BLOCK}. {RELEASED * 3}".rstrip()
    for lead in (0, len("ValueError: "), len("kvqueue._errors.HolderAuditError: ")):
        wrapped = _render.wrap(text, lead)
        assert "\n" in wrapped
        assert one_line(wrapped) == text


def test_a_missing_compiled_twin_is_said_in_lines_that_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing() -> None:
        raise ImportError("No module named 'kvqueue._queue'")

    monkeypatch.setattr(_twin, "_compiled", missing)
    with pytest.raises(ImportError) as raised:
        _twin.named("cython")
    shown = "".join(traceback.format_exception_only(ImportError, raised.value))
    assert not _too_wide(shown), shown


# Each variable read as kvqueue's code reads it: what a caller's traceback shows.
READERS: dict[str, Callable[[], object]] = {
    _env.VLLM: lambda: _env.choice(_env.VLLM, _plugin._CHOICES, None),
    _env.MISUSE_POLICY: lambda: _policy.resolve(None),
    _env.POOL_GUARD: lambda: _env.flag(_env.POOL_GUARD, default=True),
    _env.AUDIT_EVERY: _env.audit_every,
    _env.WRAP_FOREIGN: lambda: _env.flag(_env.WRAP_FOREIGN),
    _env.PURE: lambda: _env.flag(_env.PURE),
}
# A value as long as a refusal shows it, in words and in escapes (four columns a character).
BAD_VALUES = ["sixty-four-steps-between-full-reads", "\x01" * 20]


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("name", _env.USER)
def test_a_bad_setting_fits_as_a_callers_traceback_prints_it(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"^{name} must be one of ") as raised:
        READERS[name]()
    shown = "".join(traceback.format_exception_only(type(raised.value), raised.value))
    assert not _too_wide(shown), shown


@pytest.mark.parametrize("value", BAD_VALUES)
def test_the_plugins_refusal_fits_as_a_traceback_and_as_vllms_last_words(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """Every variable bad at once: the plugin's SettingError names each, in lines that fit
    after its type (a caller that catches it as a ValueError) and after ``kvqueue: `` (its
    ``code``, which ends vLLM's process)."""
    for name in _env.USER:
        monkeypatch.setenv(name, value)
    decided = _plugin.plan()
    assert decided.action == "refuse"
    assert len(decided.problems) == len(_env.USER)
    exc = decided.error
    assert isinstance(exc, _errors.SettingError)
    shown = "".join(traceback.format_exception_only(type(exc), exc))
    assert not _too_wide(shown), shown
    assert isinstance(exc.code, str)
    assert not _too_wide(exc.code), exc.code
    assert one_line(exc) == "; ".join(decided.problems)
    assert one_line(exc.code) == f"kvqueue: {one_line(exc)}"


@contextlib.contextmanager
def _records() -> Iterator[list[logging.LogRecord]]:
    """Every record the ``kvqueue`` logger hands its handlers, whatever the rate limit left."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep(logging.DEBUG)
    saved = _log.logger.level, _log._window_start
    _log.logger.addHandler(keep)
    _log.logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        _log.logger.removeHandler(keep)
        _log.logger.setLevel(saved[0])


def _assert_fit(records: list[logging.LogRecord], count: int) -> None:
    assert len(records) == count
    for record in records:
        message = record.getMessage()
        assert not _too_wide(message), message


def test_a_queues_repair_is_logged_in_lines_that_fit(
    queue_mod: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_log, "_window_start", float("-inf"))
    pool = object()
    blocks = [KVCacheBlock(1_048_570 + i, pool=pool) for i in range(4)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks, on_misuse="repair")
    taken = queue.popleft()
    with _records() as records:
        queue.remove(taken)
        queue.append_n([blocks[1]])
        queue.prepend_n([KVCacheBlock(1_048_575, pool=object())])
    _assert_fit(records, 3)


def test_the_pool_guards_repairs_are_logged_in_lines_that_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_log, "_window_start", float("-inf"))
    kinds: tuple[_policy.PoolMisuse, ...] = ("double_free", "negative_ref", "held_free")
    notes = [(CALL, kind, 1_000_000, BLOCK, _policy.REPAIRED[kind], POOL) for kind in kinds]
    with _records() as records:
        _from_vllm(notes, _report.log_notes)  # type: ignore[arg-type]
    _assert_fit(records, len(kinds))


def test_the_audits_repairs_and_a_stale_index_are_logged_in_lines_that_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_log, "_window_start", float("-inf"))

    class Manager:
        def __init__(self) -> None:
            self.req_to_blocks: dict[str, list[KVCacheBlock]] = {r: [] for _, r in HOLDERS}

    class StaleIndex:
        def rebuild(self) -> bool:
            return True

    block, manager = _held(0), Manager()
    for _, request in HOLDERS:
        manager.req_to_blocks[request].append(block)
    found = [(kind, block) for kind in _policy.AUDIT_MISUSES]
    with _records() as records:
        # Partials, not lambdas: no frame of this file's between the caller and kvqueue.
        repair = functools.partial(_audit._found, managers=[manager], found=found, policy="repair")
        _from_vllm(POOL, repair)  # type: ignore[arg-type]
        _from_vllm(POOL, functools.partial(_audit._rebuilt, index=StaleIndex()))  # type: ignore[arg-type]
    _assert_fit(records, len(found) + 1)


def test_any_record_of_kvqueues_is_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a new log line will say is not known here: the logger wraps whatever it is."""
    monkeypatch.setattr(_log, "_window_start", float("-inf"))
    with _records() as records:
        _log.logger.warning("kvqueue stays off (%s=auto): %s", "KVQUEUE_VLLM", WHERE * 3)
        _log.repaired("%s repaired something new: %s", CALL, WHERE * 3)
    _assert_fit(records, 2)
    assert " ".join(records[0].getMessage().split()).endswith(" ".join((WHERE * 3).split()))


def test_an_exceptions_message_in_a_record_flows_as_one_paragraph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Wrapped for its traceback, then put after a record's own words (why kvqueue stays
    off): its lines flow again, none left short where the traceback's type was."""
    monkeypatch.setattr(_log, "_window_start", float("-inf"))
    exc = RAISED["not_accepted_older"]()
    with _records() as records:
        _log.logger.warning("kvqueue stays off (%s=auto): %s", "KVQUEUE_VLLM", exc)
    _assert_fit(records, 1)
    flowed = _render.wrap(f"kvqueue stays off (KVQUEUE_VLLM=auto): {one_line(exc)}")
    assert records[0].getMessage() == flowed


def test_python_m_kvqueue_prints_lines_that_fit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvqueue import __main__

    monkeypatch.setenv("KVQUEUE_VLLM", "cython-please-with-a-long-value")
    monkeypatch.setenv("KVQUEUE_AUDIT_EVERY", "sixty-four-steps-between-full-reads")
    monkeypatch.setenv("KVQUEUE_ON_MISUSE", "repair")
    assert __main__.main([]) == 1
    out = capsys.readouterr().out
    assert not _too_wide(out), out
