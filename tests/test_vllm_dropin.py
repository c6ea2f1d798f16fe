"""kvqueue.vllm on a fake vLLM module tree (the real vLLM: vllm_tests/)."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

import kvqueue
import kvqueue.vllm as kv_vllm
from kvqueue import _env
from kvqueue.vllm import _audit, _lines, _plugin
from kvqueue.vllm._lines import LINES, Line, find

from support.blocks import layout
from support.helpers import one_line, raises_said
from support.vllm_stubs import MANAGER, POOL, UTILS, VllmQueue, as_vllms, manager_module

# The versions these tests name, all from the lines' table: the newest line, a release one
# line newer (not accepted yet) and one line older than the oldest (not accepted).
NEWEST = LINES[-1]
NEWER = f"{NEWEST.minor[0]}.{NEWEST.minor[1] + 1}.0"
OLDER = f"{LINES[0].minor[0]}.{LINES[0].minor[1] - 1}.1"

# A stand-in for vLLM's BlockPool with the guarded methods a line defines (their parameter
# names are the line's: install() checks them); it looks the queue up by its module-global
# name at construction, as vLLM's does.
POOL_SOURCE = textwrap.dedent(
    """
    import weakref
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

    class BlockPool:
        def __init__(self, num_gpu_blocks):
            self.num_gpu_blocks = num_gpu_blocks
            self._weak_self = weakref.ref(self)
            self.blocks = [KVCacheBlock(idx, **OWNER(self)) for idx in range(num_gpu_blocks)]
            self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
            self.null_block = self.free_block_queue.popleft()
            self.null_block.is_null = True

        def get_num_free_blocks(self):
            return self.free_block_queue.num_free_blocks

        def get_new_blocks(self, num_blocks):
            if num_blocks > self.get_num_free_blocks():
                raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
            blocks = self.free_block_queue.popleft_n(num_blocks)
            for block in blocks:
                block.ref_cnt += 1
            return blocks

        def touch(self, blocks):
            for block in blocks:
                if block.ref_cnt == 0 and not block.is_null:
                    self.free_block_queue.remove(block)
                block.ref_cnt += 1

        def free_blocks(self, ordered_blocks, *rest):
            if COUNTS_FIRST:  # vLLM 0.23: every count released, then every occurrence at 0 queued
                blocks = list(ordered_blocks)
                for block in blocks:
                    block.ref_cnt -= 1
                freed = [block for block in blocks if block.ref_cnt == 0 and not block.is_null]
            else:
                freed = []
                for block in ordered_blocks:
                    block.ref_cnt -= 1
                    if block.ref_cnt == 0 and not block.is_null:
                        freed.append(block)
            self.free_block_queue.append_n(freed)

        def unpin_blocks(self, blocks, on_reuse):
            self.free_blocks(blocks)
    """
)


def _module(name: str, **attrs: Any) -> Any:
    module = ModuleType(name)
    module.__dict__.update(attrs)
    return module


def line_block(line: Line) -> type:
    """A slotted dataclass with ``line``'s ``KVCacheBlock`` fields."""
    return layout("KVCacheBlock", line.block_fields)


def _line_pool(pool: Any, line: Line) -> None:
    """Give the fake ``BlockPool`` exactly ``line``'s guarded methods and parameters."""
    cls = pool.BlockPool
    pool.OWNER = (lambda p: {"pool": line.pool_ref(p)}) if line.has_pool_field else (lambda p: {})
    pool.COUNTS_FIRST = line.counts_first
    if "unpin_blocks" not in line.pool_methods:
        del cls.unpin_blocks
    first, *rest = line.pool_methods["free_blocks"]
    source = f"def free_blocks(self, {', '.join([first, *(f'{name}=False' for name in rest)])}):\n"
    body = f"    return BlockPool._free(self, {first})\n"
    cls._free = cls.free_blocks
    exec(compile(source + body, "<fake block_pool>", "exec"), pool.__dict__)
    function = pool.__dict__.pop("free_blocks")
    function.__qualname__ = "BlockPool.free_blocks"
    cls.free_blocks = function


def line_queue(line: Line) -> type:
    """vLLM's queue as ``line`` has it: VllmQueue's methods, less those it lacks."""
    namespace = {
        k: v for k, v in vars(VllmQueue).items() if k.startswith("_") or k in line.queue_methods
    }
    return as_vllms(type("FreeKVCacheBlockQueue", (), namespace))


class FakeVllm:
    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        version: str | None = None,
        block_class: Any = ...,
        queue_class: type | None = None,
        line: Line = NEWEST,
    ) -> None:
        self.monkeypatch = monkeypatch
        if block_class is ...:  # the line's own
            block_class = line_block(line)
        self.block_class = block_class
        if queue_class is None:
            queue_class = VllmQueue if line is NEWEST else line_queue(line)
        self.vllm = _module("vllm", __version__=line.release if version is None else version)
        self.utils = _module(UTILS, KVCacheBlock=block_class, FreeKVCacheBlockQueue=queue_class)
        self.queue_class = queue_class
        for module in (
            self.vllm,
            _module("vllm.v1"),
            _module("vllm.v1.core"),
            self.utils,
        ):
            monkeypatch.setitem(sys.modules, module.__name__, module)
        self.pool = _module(POOL, OWNER=lambda p: {"pool": p}, COUNTS_FIRST=False)
        # Imported (and so bound) before install, like vLLM's engine core would.
        monkeypatch.setitem(sys.modules, POOL, self.pool)
        exec(compile(POOL_SOURCE, "<fake block_pool>", "exec"), self.pool.__dict__)
        _line_pool(self.pool, line)
        self.manager = manager_module()
        monkeypatch.setitem(sys.modules, MANAGER, self.manager)

    def bindings(self) -> tuple[Any, Any]:
        """The queue class that each module's name builds."""
        return _builds(self.utils.FreeKVCacheBlockQueue), _builds(self.pool.FreeKVCacheBlockQueue)


def _builds(name: Any) -> Any:
    return name.queue_class if isinstance(name, kv_vllm._QueueName) else name


@pytest.fixture(autouse=True)
def _clean_install() -> Iterator[None]:
    kv_vllm.uninstall()
    yield
    kv_vllm.uninstall()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeVllm:
    return FakeVllm(monkeypatch)


def _implementation(queue_mod: ModuleType) -> kv_vllm.Implementation:
    return "cython" if queue_mod.__name__ == "kvqueue._queue" else "python"


def test_import_kvqueue_does_not_import_vllm() -> None:
    code = textwrap.dedent(
        """
        import sys
        seen = []
        class Spy:
            def find_spec(self, name, path=None, target=None):
                if name == "vllm" or name.startswith("vllm."):
                    seen.append(name)
                return None
        sys.meta_path.insert(0, Spy())
        import kvqueue, kvqueue.vllm
        kvqueue.vllm.status()["implementation"]
        assert not seen, seen
        assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_install_patches_the_pool_lookup(fake: FakeVllm, queue_mod: ModuleType) -> None:
    queue_class = queue_mod.FreeKVCacheBlockQueue
    assert kv_vllm.install(_implementation(queue_mod)) is queue_class
    assert fake.bindings() == (queue_class, queue_class)
    assert kv_vllm.status()["implementation"] == _implementation(queue_mod)
    pool = fake.pool.BlockPool(8)
    queue: Any = pool.free_block_queue
    assert type(pool.free_block_queue) is queue_class
    # vLLM's block class, unchanged, is the queue's block class.
    assert queue.block_type is fake.block_class
    assert type(queue.fake_free_list_head) is fake.block_class
    assert pool.null_block is pool.blocks[0]
    assert queue.num_free_blocks == 7
    popped = queue.popleft_n(3)
    assert [b.block_id for b in popped] == [1, 2, 3]
    queue.prepend_n(popped[::-1])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [3, 2, 1, 4, 5, 6, 7]


def test_install_auto_uses_the_shims_choice(fake: FakeVllm) -> None:
    assert kv_vllm.install() is kvqueue.FreeKVCacheBlockQueue
    assert kv_vllm.status()["implementation"] == kvqueue.IMPLEMENTATION


def test_idempotent_and_reversible(fake: FakeVllm, queue_mod: ModuleType) -> None:
    impl = _implementation(queue_mod)
    before = fake.pool.BlockPool(4)
    first = kv_vllm.install(impl)
    assert kv_vllm.install(impl) is first
    assert fake.bindings() == (first, first)
    assert kv_vllm.uninstall() is True
    assert fake.bindings() == (VllmQueue, VllmQueue)
    assert kv_vllm.status()["implementation"] is None
    assert kv_vllm.uninstall() is False
    assert fake.bindings() == (VllmQueue, VllmQueue)
    # A pool built before install keeps vLLM's queue.
    assert type(before.free_block_queue) is VllmQueue
    assert type(fake.pool.BlockPool(4).free_block_queue) is VllmQueue
    # And it installs again after an uninstall.
    assert kv_vllm.install(impl) is first
    assert fake.bindings() == (first, first)


@pytest.mark.cython
def test_switch_implementation(fake: FakeVllm) -> None:
    from kvqueue import _queue, _queue_py

    kv_vllm.install("python")
    assert kv_vllm.install("cython") is _queue.FreeKVCacheBlockQueue
    assert fake.bindings() == (_queue.FreeKVCacheBlockQueue,) * 2
    assert kv_vllm.status()["implementation"] == "cython"
    kv_vllm.install("python")
    assert fake.bindings() == (_queue_py.FreeKVCacheBlockQueue,) * 2
    kv_vllm.uninstall()
    assert fake.bindings() == (VllmQueue, VllmQueue)


def test_patched_context_manager(fake: FakeVllm, queue_mod: ModuleType) -> None:
    with kv_vllm.patched(_implementation(queue_mod)) as queue_class:
        assert queue_class is queue_mod.FreeKVCacheBlockQueue
        assert type(fake.pool.BlockPool(4).free_block_queue) is queue_class
    assert fake.bindings() == (VllmQueue, VllmQueue)
    assert kv_vllm.status()["implementation"] is None


@pytest.mark.cython
def test_patched_keeps_an_earlier_install(fake: FakeVllm) -> None:
    kv_vllm.install("python")
    with kv_vllm.patched("cython"):
        assert kv_vllm.status()["implementation"] == "cython"
    assert kv_vllm.status()["implementation"] == "python"


def test_patches_other_loaded_importers(fake: FakeVllm, monkeypatch: pytest.MonkeyPatch) -> None:
    other = _module("vllm.v1.core.other", FreeKVCacheBlockQueue=VllmQueue)
    unrelated = _module("vllmx", FreeKVCacheBlockQueue=VllmQueue)
    monkeypatch.setitem(sys.modules, other.__name__, other)
    monkeypatch.setitem(sys.modules, unrelated.__name__, unrelated)
    queue_class = kv_vllm.install("python")
    assert _builds(other.FreeKVCacheBlockQueue) is queue_class
    assert unrelated.FreeKVCacheBlockQueue is VllmQueue
    kv_vllm.uninstall()
    assert other.FreeKVCacheBlockQueue is VllmQueue


def test_uninstall_leaves_a_later_patch_alone(fake: FakeVllm) -> None:
    kv_vllm.install("python")

    class Theirs:
        pass

    fake.pool.FreeKVCacheBlockQueue = Theirs
    kv_vllm.uninstall()
    assert fake.bindings() == (VllmQueue, Theirs)


@pytest.mark.parametrize(
    "version",
    [f"{NEWEST.name}.{tail}" for tail in ("0", "2", "1rc1", "0.dev12+g0abc")],
)
def test_known_versions(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    fake = FakeVllm(monkeypatch, version=version)
    queue_class = kv_vllm.install("python")
    assert fake.bindings() == (queue_class, queue_class)


@pytest.mark.parametrize("line", LINES, ids=lambda line: line.name)
def test_every_accepted_line_installs_with_its_own_layout(
    monkeypatch: pytest.MonkeyPatch, line: Line
) -> None:
    fake = FakeVllm(monkeypatch, line=line)
    queue_class = kv_vllm.install("python")
    assert fake.bindings() == (queue_class, queue_class)
    state = kv_vllm.status()
    assert (state["line"], state["guarded"]) == (line.name, sorted(line.pool_methods))
    pool = fake.pool.BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 3
    kv_vllm.uninstall()
    assert fake.bindings() == (fake.queue_class, fake.queue_class)


def _assert_refused(fake: FakeVllm, match: str, **kwargs: Any) -> None:
    with raises_said(kv_vllm.VLLMLayoutError, match):
        kv_vllm.install("python", **kwargs)
    assert fake.bindings() == (fake.queue_class, fake.queue_class)
    assert kv_vllm.status()["implementation"] is None


ACCEPTED = (
    rf"kvqueue accepts the vLLM lines .*\({re.escape(LINES[0].name)}, "
    rf"{re.escape(LINES[1].name)}, .*, {re.escape(NEWEST.name)}\)"
)


@pytest.mark.parametrize("version", [OLDER, NEWER, "1.0.0", "dev", "0", ""])
def test_unknown_version_refused(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    fake = FakeVllm(monkeypatch, version=version)
    _assert_refused(fake, ACCEPTED)
    # The version check alone can be skipped: the line whose layout this is is taken.
    assert kv_vllm.install("python", check_version=False) is not None
    assert kv_vllm.status()["line"] == NEWEST.name


@pytest.mark.parametrize(
    ("version", "line", "match"),
    [
        ("0.31.0", LINES[0], "is not what kvqueue knows of vLLM 0.31: KVCacheBlock has fields"),
        ("0.23.0", LINES[-1], "is not what kvqueue knows of vLLM 0.23: KVCacheBlock has fields"),
        ("0.25.1", find("0.26.0"), "of vLLM 0.25: FreeKVCacheBlockQueue has methods"),
        # A queue with front insertion is not what the lines before 0.23 have.
        ("0.22.1", find("0.23.0"), "of vLLM 0.22: FreeKVCacheBlockQueue has methods"),
    ],
)
def test_a_layout_unlike_its_lines_refused(
    monkeypatch: pytest.MonkeyPatch, version: str, line: Line, match: str
) -> None:
    fake = FakeVllm(monkeypatch, version=version, line=line)
    _assert_refused(fake, match)


def test_a_pool_method_unlike_its_lines_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeVllm(monkeypatch)
    del fake.pool.BlockPool.unpin_blocks
    _assert_refused(fake, rf"BlockPool lacks unpin_blocks\(\), unlike vLLM {NEWEST.name}")
    fake = FakeVllm(monkeypatch)
    exec("def free_blocks(self, blocks): pass", fake.pool.__dict__)
    fake.pool.BlockPool.free_blocks = fake.pool.__dict__.pop("free_blocks")
    _assert_refused(fake, rf"BlockPool.free_blocks\('blocks',\) differs from vLLM {NEWEST.name}'s")


def test_missing_version_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeVllm(monkeypatch)
    del fake.vllm.__version__
    monkeypatch.setattr("importlib.metadata.version", _no_distribution)
    _assert_refused(fake, ACCEPTED + ", not an unknown version")


def _no_distribution(name: str) -> str:
    from importlib.metadata import PackageNotFoundError

    raise PackageNotFoundError(name)


# The newest line's fields, then layouts that differ from every line's (one field more; the
# hash's token count moved after the links).
_FIELDS = NEWEST.block_fields
ExtraFieldBlock = layout("ExtraFieldBlock", (*_FIELDS, "last_access"))
ReorderedBlock = layout("ReorderedBlock", (*_FIELDS[:4], *_FIELDS[5:7], _FIELDS[4], *_FIELDS[7:]))
UnslottedBlock = layout("UnslottedBlock", _FIELDS, slots=False)


@pytest.mark.parametrize(
    ("block_class", "match"),
    [
        (ExtraFieldBlock, f"has fields .*last_access.*vLLM {NEWEST.name}'s are"),
        (ReorderedBlock, f"vLLM {NEWEST.name}'s are"),
        (UnslottedBlock, "must be a __slots__ member"),
        (kvqueue.KVCacheBlock, "is not a dataclass"),
        (None, "is not a dataclass"),
    ],
)
def test_unknown_block_layout_refused(
    monkeypatch: pytest.MonkeyPatch, block_class: Any, match: str
) -> None:
    fake = FakeVllm(monkeypatch, block_class=block_class)
    _assert_refused(fake, match)
    reordered = block_class in (ExtraFieldBlock, ReorderedBlock)
    _assert_refused(
        fake, "the layout of no accepted line" if reordered else match, check_version=False
    )


def test_unknown_queue_api_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    @as_vllms
    class NewerQueue(VllmQueue):
        def popleft_until(self, block: Any) -> None: ...

    fake = FakeVllm(monkeypatch, queue_class=NewerQueue)
    fake.pool.FreeKVCacheBlockQueue = NewerQueue
    _assert_refused(fake, "FreeKVCacheBlockQueue has methods .*popleft_until")


def test_foreign_patch_refused(fake: FakeVllm) -> None:
    class Theirs:
        pass

    fake.pool.FreeKVCacheBlockQueue = Theirs
    with raises_said(kv_vllm.VLLMLayoutError, r"block_pool.FreeKVCacheBlockQueue .*Theirs"):
        kv_vllm.install("python")
    assert fake.bindings() == (VllmQueue, Theirs)
    assert kv_vllm.status()["implementation"] is None


def test_foreign_queue_method_refused_unless_asked(fake: FakeVllm) -> None:
    """A queue method patched in place (as vllm-ascend does) is named, module and all."""

    def append_n(self: Any, blocks: Any) -> None: ...

    fake.monkeypatch.setattr(VllmQueue, "append_n", append_n)
    with raises_said(kv_vllm.VLLMLayoutError, r"FreeKVCacheBlockQueue.append_n .*test_vllm_dropin"):
        kv_vllm.install("python")
    assert fake.bindings() == (VllmQueue, VllmQueue)
    from kvqueue._queue_py import FreeKVCacheBlockQueue as Pure

    kv_vllm.install("python", wrap_foreign=True)
    assert fake.bindings() == (Pure, Pure)


def test_bad_implementation_name(fake: FakeVllm) -> None:
    with pytest.raises(ValueError, match="implementation must be"):
        kv_vllm.install("rust")  # type: ignore[arg-type]
    assert fake.bindings() == (VllmQueue, VllmQueue)


def test_no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError):
        kv_vllm.install("python")
    assert kv_vllm.status()["implementation"] is None


def test_empty_queue_threads_vllms_block(fake: FakeVllm, queue_mod: ModuleType) -> None:
    # vLLM's test_free_kv_cache_block_queue_append_n: an empty queue, then vLLM's blocks.
    kv_vllm.install(_implementation(queue_mod))
    queue = fake.utils.FreeKVCacheBlockQueue([])
    assert type(queue) is queue_mod.FreeKVCacheBlockQueue
    assert queue.block_type is fake.block_class
    blocks = [fake.block_class(i) for i in range(3)]
    queue.append_n(blocks)
    assert queue.get_all_free_blocks() == blocks
    # Also from an empty iterator, and an explicit block_type still wins.
    assert fake.pool.FreeKVCacheBlockQueue(iter(())).block_type is fake.block_class
    own = fake.utils.FreeKVCacheBlockQueue([], block_type=kvqueue.KVCacheBlock)
    assert own.block_type is kvqueue.KVCacheBlock
    # kvqueue's own name keeps kvqueue's default.
    assert queue_mod.FreeKVCacheBlockQueue([]).block_type is kvqueue.KVCacheBlock


def test_the_bound_name_looks_like_the_class(fake: FakeVllm, queue_mod: ModuleType) -> None:
    queue_class: Any = kv_vllm.install(_implementation(queue_mod))
    name = fake.pool.FreeKVCacheBlockQueue
    pool = fake.pool.BlockPool(4)
    assert isinstance(pool.free_block_queue, name)
    assert issubclass(queue_class, name)
    assert not isinstance(VllmQueue([]), name)
    assert name.popleft is queue_class.popleft
    assert name.__name__ == "FreeKVCacheBlockQueue"


@pytest.mark.parametrize("policy", ["raise", "repair"])
def test_install_policy(fake: FakeVllm, queue_mod: ModuleType, policy: str) -> None:
    kv_vllm.install(_implementation(queue_mod), on_misuse=policy)  # type: ignore[arg-type]
    assert kv_vllm.status()["on_misuse"] == policy
    pool = fake.pool.BlockPool(4)
    assert pool.free_block_queue.on_misuse == policy
    block = pool.free_block_queue.popleft()
    pool.free_block_queue.append(block)
    if policy == "repair":
        pool.free_block_queue.append(block)
        assert pool.free_block_queue.repairs["linked"] == 1
    else:
        with raises_said(ValueError, "linked"):
            pool.free_block_queue.append(block)
    assert pool.free_block_queue.num_free_blocks == 3
    other = "raise" if policy == "repair" else "repair"
    explicit = fake.utils.FreeKVCacheBlockQueue([], on_misuse=other)
    assert explicit.on_misuse == other


def test_install_policy_none_reads_the_environment(
    fake: FakeVllm, queue_mod: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv_vllm.install(_implementation(queue_mod))
    assert kv_vllm.status()["on_misuse"] is None
    monkeypatch.setenv("KVQUEUE_ON_MISUSE", "repair")
    assert fake.pool.BlockPool(2).free_block_queue.on_misuse == "repair"
    monkeypatch.setenv("KVQUEUE_ON_MISUSE", "raise")
    assert fake.pool.BlockPool(2).free_block_queue.on_misuse == "raise"


def test_install_policy_switches_and_restores(fake: FakeVllm, queue_mod: ModuleType) -> None:
    impl = _implementation(queue_mod)
    kv_vllm.install(impl, on_misuse="raise")
    with kv_vllm.patched(impl, on_misuse="repair"):
        assert fake.pool.BlockPool(2).free_block_queue.on_misuse == "repair"
    assert kv_vllm.status()["on_misuse"] == "raise"
    assert fake.pool.BlockPool(2).free_block_queue.on_misuse == "raise"
    kv_vllm.uninstall()
    assert fake.bindings() == (VllmQueue, VllmQueue)


def test_status_says_each_live_pools_policy(fake: FakeVllm, queue_mod: ModuleType) -> None:
    """A pool keeps the policy it was built under, which its guard follows and status() says,
    whatever install() said since; a pool that is gone is not said."""
    impl = _implementation(queue_mod)
    gc.collect()
    was = kv_vllm.status()["pools"]
    kv_vllm.install(impl, on_misuse="repair")
    repairing = fake.pool.BlockPool(4)
    kv_vllm.install(impl, on_misuse="raise")
    raising = fake.pool.BlockPool(2)
    assert kv_vllm.status()["on_misuse"] == "raise"
    assert kv_vllm.status()["pools"] == [
        *was,
        {"on_misuse": "repair", "blocks": 4},
        {"on_misuse": "raise", "blocks": 2},
    ]
    (block,) = repairing.get_new_blocks(1)
    repairing.free_blocks([block, block])
    assert kv_vllm.pool_repairs(repairing)["double_free"] == 1
    (block,) = raising.get_new_blocks(1)
    with raises_said(ValueError, "double free"):
        raising.free_blocks([block, block])
    del repairing
    gc.collect()
    assert kv_vllm.status()["pools"] == [*was, {"on_misuse": "raise", "blocks": 2}]


def test_install_policy_refused(fake: FakeVllm) -> None:
    with pytest.raises(ValueError, match="on_misuse"):
        kv_vllm.install("python", on_misuse="ignore")  # type: ignore[arg-type]
    assert fake.bindings() == (VllmQueue, VllmQueue)
    assert kv_vllm.status()["implementation"] is None


def test_full_cache_faked_through_the_pool(fake: FakeVllm, queue_mod: ModuleType) -> None:
    # vLLM's connector tests: free_block_queue.num_free_blocks = 0 fakes a full cache.
    kv_vllm.install(_implementation(queue_mod))
    queue = fake.pool.BlockPool(5).free_block_queue
    queue.num_free_blocks = 0
    assert queue.num_free_blocks == 0
    queue.append(queue.popleft())
    assert queue.num_free_blocks == 0


@pytest.mark.parametrize("value", [None, "", "0"])
def test_plugin_off_unless_asked(
    fake: FakeVllm, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(_env.VLLM, raising=False)
    else:
        monkeypatch.setenv(_env.VLLM, value)
    _plugin.plugin()
    assert kv_vllm.status()["implementation"] is None
    assert fake.bindings() == (VllmQueue, VllmQueue)


@pytest.mark.parametrize(
    ("value", "implementation"), [("1", None), ("auto", None), ("python", "python")]
)
def test_plugin_installs_and_is_idempotent(
    fake: FakeVllm, monkeypatch: pytest.MonkeyPatch, value: str, implementation: str | None
) -> None:
    monkeypatch.setenv(_env.VLLM, value)
    monkeypatch.setenv("KVQUEUE_ON_MISUSE", "repair")
    _plugin.plugin()
    expected = implementation or kvqueue.IMPLEMENTATION
    assert kv_vllm.status()["implementation"] == expected
    assert kv_vllm.status()["on_misuse"] == "repair"
    bound = fake.pool.FreeKVCacheBlockQueue
    _plugin.plugin()
    assert fake.pool.FreeKVCacheBlockQueue is bound
    assert fake.pool.BlockPool(3).free_block_queue.on_misuse == "repair"


@pytest.mark.parametrize(("name", "value"), [("KVQUEUE_VLLM", "yes"), ("KVQUEUE_ON_MISUSE", "x")])
def test_plugin_refuses_unknown_values(
    fake: FakeVllm, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(_env.VLLM, "python")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        _plugin.plugin()
    assert kv_vllm.status()["implementation"] is None
    assert fake.bindings() == (VllmQueue, VllmQueue)


def test_plugin_entry_point_is_installed() -> None:
    from importlib.metadata import entry_points

    points = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert points.get("kvqueue") == "kvqueue.vllm._plugin:plugin"


def test_a_module_imported_after_install_is_switched_and_restored(
    fake: FakeVllm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vllm.* module that took the name from kvqueue's stand-in, after install()."""
    from kvqueue import _queue_py

    first = kv_vllm.install("python", on_misuse="raise")
    late = _module("vllm.v1.core.late", FreeKVCacheBlockQueue=fake.utils.FreeKVCacheBlockQueue)
    monkeypatch.setitem(sys.modules, late.__name__, late)
    assert _builds(late.FreeKVCacheBlockQueue) is first is _queue_py.FreeKVCacheBlockQueue
    kv_vllm.install("python", on_misuse="repair")
    assert late.FreeKVCacheBlockQueue is fake.utils.FreeKVCacheBlockQueue
    assert late.FreeKVCacheBlockQueue([]).on_misuse == "repair"
    kv_vllm.uninstall()
    assert late.FreeKVCacheBlockQueue is VllmQueue


def test_plugin_keeps_an_applications_policy(
    fake: FakeVllm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVQUEUE_ON_MISUSE unset: the policy the application gave install() stays."""
    kv_vllm.install("python", on_misuse="repair")
    monkeypatch.setenv(_env.VLLM, "python")
    monkeypatch.delenv("KVQUEUE_ON_MISUSE", raising=False)
    _plugin.plugin()
    assert kv_vllm.status()["on_misuse"] == "repair"
    monkeypatch.setenv("KVQUEUE_ON_MISUSE", "raise")
    _plugin.plugin()  # the environment, set, decides
    assert kv_vllm.status()["on_misuse"] == "raise"


@pytest.mark.parametrize("value", ["yes", "true", " 0", "2"])
def test_plugin_refuses_unknown_guard_switch(
    fake: FakeVllm, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(_env.VLLM, "python")
    monkeypatch.setenv(_env.POOL_GUARD, value)
    with pytest.raises(ValueError, match="KVQUEUE_POOL_GUARD must be one of '1', '0'"):
        _plugin.plugin()
    assert kv_vllm.status()["implementation"] is None


def test_a_module_whose_getattr_raises_changes_nothing(
    fake: FakeVllm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's lazy modules raise from ``__getattr__`` when an optional dependency is
    missing: install() reads modules' namespaces, so none of them can fail it halfway."""

    def __getattr__(name: str) -> Any:
        raise ImportError(f"optional dependency for {name} missing")

    lazy = _module("vllm.lazy", __getattr__=__getattr__)
    monkeypatch.setitem(sys.modules, lazy.__name__, lazy)
    queue_class = kv_vllm.install("python")
    assert fake.bindings() == (queue_class, queue_class)
    assert kv_vllm.uninstall()
    assert fake.bindings() == (VllmQueue, VllmQueue)
    assert kv_vllm.status()["guarded"] == []


def _auto_stays_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, version: str
) -> tuple[FakeVllm, str]:
    """The plugin under KVQUEUE_VLLM=auto on vLLM ``version``, checked to leave kvqueue off and
    vLLM's queue bound, with one WARNING: the fake, and that WARNING's lines as one line."""
    fake = FakeVllm(monkeypatch, version=version)
    monkeypatch.setenv(_env.VLLM, "auto")
    with caplog.at_level("WARNING", logger="kvqueue"):
        _plugin.plugin()
    assert kv_vllm.status()["implementation"] is None
    assert fake.bindings() == (VllmQueue, VllmQueue)
    [record] = caplog.records
    assert record.levelname == "WARNING"
    return fake, " ".join(record.getMessage().split())


def test_plugin_auto_stays_off_on_a_line_it_does_not_accept(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake, message = _auto_stays_off(monkeypatch, caplog, OLDER)
    assert fake.pool.BlockPool.free_blocks.__module__ == POOL
    assert "kvqueue stays off (KVQUEUE_VLLM=auto)" in message
    assert f"{LINES[0].name}, {LINES[1].name}" in message
    assert f"not vLLM {OLDER} ({_lines.OLDER})" in message


def test_plugin_auto_on_a_newer_vllm_says_what_and_how_to_check(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One WARNING: the version, the newest accepted line, and how to check for a kvqueue
    that accepts it; vLLM runs on, untouched."""
    _, message = _auto_stays_off(monkeypatch, caplog, NEWER)
    assert f"not vLLM {NEWER}: vLLM {NEWER} is newer than the newest line" in message
    assert f"({NEWEST.name}, proven at {NEWEST.release})" in message
    assert f"make vllm-line-check VLLM={NEWER}" in message


@pytest.mark.parametrize("value", ["1", "python"])
def test_plugin_strict_stops_a_line_it_does_not_accept(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    fake = FakeVllm(monkeypatch, version=NEWER)
    monkeypatch.setenv(_env.VLLM, value)
    with raises_said(kv_vllm.VLLMLayoutError, ACCEPTED):
        _plugin.plugin()
    assert fake.bindings() == (VllmQueue, VllmQueue)


ENVIRONMENTS = [
    {},
    {"KVQUEUE_VLLM": "1"},
    {"KVQUEUE_VLLM": "auto"},
    {"KVQUEUE_VLLM": "python", "KVQUEUE_POOL_GUARD": "0"},
    {"KVQUEUE_VLLM": "1", "KVQUEUE_POOL_GUARD": "off"},
    {"KVQUEUE_VLLM": "maybe"},
    {"KVQUEUE_VLLM": "1", "KVQUEUE_ON_MISUSE": "fix"},
    {"KVQUEUE_ON_MISUSE": "fix"},
    {"KVQUEUE_VLLM": "1", "KVQUEUE_WRAP_FOREIGN": "1"},
]


@pytest.mark.parametrize("version", [LINES[0].release, OLDER])
@pytest.mark.parametrize("environment", ENVIRONMENTS, ids=str)
@pytest.mark.parametrize("foreign", [False, True], ids=["own", "foreign"])
def test_the_plan_is_what_the_plugin_does(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], version: str, foreign: bool
) -> None:
    """``python -m kvqueue`` prints kvqueue.vllm._plugin.plan(): the plugin carries it out."""

    line = LINES[0] if version == OLDER else _vllm_lines_find(version)
    fake = FakeVllm(monkeypatch, version=version, line=line)
    if foreign:
        patch = _module("theirs")
        exec("def touch(self, blocks): pass", patch.__dict__)
        fake.pool.BlockPool.touch = patch.touch
    for name in _env.USER:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    plan = _plugin.plan()
    if plan.action == "refuse":
        with pytest.raises((ValueError, kv_vllm.VLLMLayoutError)) as refused:
            _plugin.plugin()
        assert one_line(refused.value) == plan.reason
        assert kv_vllm.status()["implementation"] is None
        return
    _plugin.plugin()
    did = kv_vllm.status()
    if did["implementation"] is None:
        assert plan.action in ("off", "stay_off")
    else:
        assert plan.action == "install"
        assert plan.settings is not None
        assert did["pool_guard"] == plan.settings["pool_guard"]


def _vllm_lines_find(version: str) -> Line:
    from kvqueue.vllm._lines import find

    line = find(version)
    assert line is not None
    return line


@pytest.mark.parametrize("wrap_foreign", [False, True])
def test_another_projects_pool_method_is_named_not_taken_for_a_layout(
    fake: FakeVllm, wrap_foreign: bool
) -> None:
    """A patch with parameters of its own (``free_blocks(self, blocks)``) is another
    project's, which only wrap_foreign accepts: not a vLLM of an unknown layout."""
    theirs = _module("their_project.patches")
    exec("def free_blocks(self, blocks):\n    return MINE(self, blocks)", theirs.__dict__)
    theirs.MINE = fake.pool.BlockPool.free_blocks
    fake.pool.BlockPool.free_blocks = theirs.free_blocks
    if not wrap_foreign:
        _assert_refused(fake, r"BlockPool\.free_blocks is not vLLM's own: their_project")
        return
    kv_vllm.install("python", wrap_foreign=True)
    pool = fake.pool.BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    with raises_said(ValueError, "double free"):
        pool.free_blocks([block, block])
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 3


def test_a_bad_audit_cadence_is_refused_before_anything_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeVllm(monkeypatch)
    kv_vllm.uninstall()
    methods = dict(vars(fake.pool.BlockPool))
    monkeypatch.setenv("KVQUEUE_AUDIT_EVERY", "100")
    with pytest.raises(ValueError, match="KVQUEUE_AUDIT_EVERY must be one of '0', '1', '2'"):
        kv_vllm.install("python")
    assert dict(vars(fake.pool.BlockPool)) == methods
    assert kv_vllm.status()["implementation"] is None


def test_each_install_reads_the_audit_cadence_and_the_running_audit_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KVQUEUE_AUDIT_EVERY is read by install(), again by the next one with the same twin;
    status() says what the running audit uses, whatever the variable says since."""
    fake = FakeVllm(monkeypatch)
    kv_vllm.uninstall()
    used: list[int] = []
    monkeypatch.setattr(_audit, "read_holders", lambda *args: used.append(args[-1]))
    monkeypatch.setenv("KVQUEUE_AUDIT_EVERY", "4")
    kv_vllm.install("python")
    manager = fake.manager.KVCacheManager(fake.pool.BlockPool(4))
    manager.new_step_starts()
    monkeypatch.setenv("KVQUEUE_AUDIT_EVERY", "8")
    assert kv_vllm.status()["audit_every"] == 4
    manager.new_step_starts()
    kv_vllm.install("python")
    assert kv_vllm.status()["audit_every"] == 8
    manager.new_step_starts()
    assert used == [4, 4, 8]
    monkeypatch.delenv("KVQUEUE_AUDIT_EVERY")
    kv_vllm.install("python", pool_guard=False)
    assert kv_vllm.status()["audit_every"] is None


def test_a_later_patch_over_a_guard_is_reported_and_refused(
    fake: FakeVllm, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another project's patch over a guard after install() bypasses it:
    status(), the plugin's log line and its plan say so, install() again refuses it (or,
    wrap_foreign, guards it again), as a first install would."""

    kv_vllm.install("python", on_misuse="raise")
    theirs = _module("their_project.patches")
    exec("def free_blocks(self, blocks):\n    return MINE(self, blocks)", theirs.__dict__)
    theirs.MINE = fake.pool.BlockPool._free
    fake.pool.BlockPool.free_blocks = theirs.free_blocks
    state = kv_vllm.status()
    assert "free_blocks" not in state["guarded"]
    assert state["pool_guard"]
    assert list(state["bypassed"]) == ["free_blocks"]
    assert "their_project.patches.free_blocks" in state["bypassed"]["free_blocks"]
    monkeypatch.setenv(_env.VLLM, "1")
    monkeypatch.delenv(_env.WRAP_FOREIGN, raising=False)
    plan = _plugin.plan()
    assert plan.action == "refuse"
    assert "their_project" in plan.reason
    with raises_said(kv_vllm.VLLMLayoutError, "free_blocks is not vLLM's own"):
        kv_vllm.install("python", on_misuse="raise")
    assert kv_vllm.status()["bypassed"] == state["bypassed"]
    monkeypatch.setenv(_env.WRAP_FOREIGN, "1")
    with caplog.at_level("INFO", logger="kvqueue"):
        _plugin.plugin()
    assert kv_vllm.status()["bypassed"] == {}
    assert "free_blocks" in kv_vllm.status()["guarded"]
    pool = fake.pool.BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    with raises_said(ValueError, "double free"):
        pool.free_blocks([block, block])


@pytest.mark.parametrize("pool_guard", [True, False])
@pytest.mark.parametrize(
    "line", [each for each in LINES if each.counts_first], ids=lambda each: each.name
)
def test_a_block_freed_by_each_of_its_references_in_one_call_is_kept(
    monkeypatch: pytest.MonkeyPatch, queue_mod: ModuleType, pool_guard: bool, line: Line
) -> None:
    """VLLM 0.18-0.23 queue such a block once per occurrence, which the queue
    refuses under "raise" after vLLM released every count; with the guard off too, the
    block is queued once, at 0, not lost."""
    fake = FakeVllm(monkeypatch, line=line)
    vllms_free = fake.pool.BlockPool.free_blocks
    kv_vllm.install(_implementation(queue_mod), on_misuse="raise", pool_guard=pool_guard)
    assert kv_vllm.status()["pool_guard"] is pool_guard
    pool = fake.pool.BlockPool(8)
    queue: Any = pool.free_block_queue
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.free_blocks([block, block])
    assert block.ref_cnt == 0
    assert list(queue)[-1] is block
    assert queue.num_free_blocks == len(queue.get_all_free_blocks()) == 7
    kv_vllm.install(_implementation(queue_mod), pool_guard=not pool_guard)
    kv_vllm.install(_implementation(queue_mod), pool_guard=pool_guard)
    kv_vllm.uninstall()
    assert fake.pool.BlockPool.free_blocks is vllms_free


def test_the_correction_is_of_the_line_that_counts_first_only(fake: FakeVllm) -> None:
    vllms_free = fake.pool.BlockPool.free_blocks
    kv_vllm.install(pool_guard=False)
    assert fake.pool.BlockPool.free_blocks is vllms_free


@pytest.mark.parametrize(
    ("name", "value"), [("KVQUEUE_ON_MISUSE", "bogus"), ("KVQUEUE_AUDIT_EVERY", "3")]
)
def test_a_bad_value_ends_vllms_process_with_one_line(name: str, value: str) -> None:
    """vLLM's loader calls each general plugin bare (``func()``), in its CLI's process: a bad
    value ends that process with kvqueue's line, and no traceback."""
    code = (
        "from kvqueue.vllm._plugin import plugin\n"
        "plugins = {'kvqueue': plugin}\n"
        "for func in plugins.values():\n"
        "    func()\n"
        "print('vLLM started')\n"
    )
    # The suite's own choice of twin is kept: a pure install warns at import without it.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KVQUEUE_", "VLLM_")) or k == "KVQUEUE_PURE"
    }
    env.update({"KVQUEUE_VLLM": "1", name: value})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"kvqueue: {name} must be one of ")
    assert line.endswith(f"(or unset), not {value!r}")
    assert len(line) <= 100


def test_a_bad_value_is_a_value_error_to_code_that_catches_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVQUEUE_VLLM", "1")
    monkeypatch.setenv("KVQUEUE_ON_MISUSE", "bogus")
    with pytest.raises(ValueError, match=r"^KVQUEUE_ON_MISUSE must be one of") as caught:
        _plugin.plugin()
    assert isinstance(caught.value, SystemExit)
    assert one_line(caught.value.code) == f"kvqueue: {one_line(caught.value)}"
