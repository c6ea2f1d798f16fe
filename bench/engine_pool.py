"""vLLM's real ``BlockPool`` and ``BlockHashToBlockMap``, loaded from the published wheel.

``vllm/v1/core/block_pool.py`` is parsed with ``ast`` and exec'd whole in a fresh module
namespace; its ``from vllm... import`` statements are replaced by minimal stand-ins (a
logger, event classes, an ``envs`` namespace) and by the real small helpers and classes of
``vllm/v1/core/kv_cache_utils.py`` (``KVCacheBlock``, ``FreeKVCacheBlockQueue``, the
block-hash helpers, ``resolve_block_hashes``), themselves exec'd from the wheel. No torch,
nothing of vLLM committed: the text comes from ``vllm_source.vllm_file``.

Public API::

    engine = load_engine("0.33.0")   # cached per version
    engine.block_pool                # a module: BlockPool, BlockHashToBlockMap, ...
    engine.kv_cache_utils            # a module: KVCacheBlock, FreeKVCacheBlockQueue, ...
    engine.KVCacheBlock              # vLLM's own @dataclass(slots=True) block
    engine.vllm_queue                # vLLM's own FreeKVCacheBlockQueue (this version)
    engine.use_queue(cls)            # the queue class BlockPool.__init__ will build
    with engine.in_sys_modules(): ...  # the tree as vllm, vllm.v1.core.* (for kvqueue.vllm)

The pool's module globals are what ``BlockPool.__init__`` reads ``FreeKVCacheBlockQueue``
from, exactly as in vLLM, so ``kvqueue.vllm.install()`` works on this tree unchanged.
"""

from __future__ import annotations
import __future__

import ast
import hashlib
import logging
import pickle
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

import vllm_source

__all__ = ("Engine", "load_engine", "vllm_sha256")

POOL_FILE = "vllm/v1/core/block_pool.py"
UTILS_FILE = "vllm/v1/core/kv_cache_utils.py"
UTILS = "vllm.v1.core.kv_cache_utils"
POOL = "vllm.v1.core.block_pool"

# Besides what block_pool.py imports from kv_cache_utils.py, the definitions those need
# (and the trace's hash_block_tokens), where this version has them.
UTILS_HELPERS = ("hash_block_tokens", "BlockHashListWithBlockSize", "BlockHashList")


def vllm_sha256(value: Any) -> bytes:
    """vLLM's default prefix-caching hash: SHA-256 of the pickled value."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


class _Event:
    """Stands in for vLLM's KV-cache event classes (msgspec structs): keeps its fields."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__!r})"


class KVCacheEvent(_Event):
    pass


class BlockStored(KVCacheEvent):
    pass


class BlockRemoved(KVCacheEvent):
    pass


class AllBlocksCleared(KVCacheEvent):
    pass


def _unsupported(name: str) -> Callable[..., Any]:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name} is not loaded (multimodal / event extra keys)")

    stand_in.__name__ = name
    return stand_in


def _stand_ins() -> dict[str, Any]:
    """Every name block_pool.py / kv_cache_utils.py import from vllm that we provide."""
    return {
        "envs": types.SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=False),
        "init_logger": logging.getLogger,
        "MEDIUM_GPU": "GPU",
        "KVCacheEvent": KVCacheEvent,
        "BlockStored": BlockStored,
        "BlockRemoved": BlockRemoved,
        "AllBlocksCleared": AllBlocksCleared,
        "get_mm_features_in_window": _unsupported("get_mm_features_in_window"),
        "generate_block_hash_extra_keys": _unsupported("generate_block_hash_extra_keys"),
        "generate_lookahead_block_hash_extra_keys": _unsupported(
            "generate_lookahead_block_hash_extra_keys"
        ),
        # Annotations only (not evaluated: the files are compiled with postponed annotations).
        "KVCacheMetricsCollector": object,
        "Request": object,
        "VllmConfig": object,
    }


def _compile(nodes: list[ast.stmt], version: str, relpath: str) -> types.CodeType:
    filename = str(vllm_source.cache_dir() / f"vllm-{version}" / relpath)
    code: types.CodeType = compile(
        ast.Module(body=nodes, type_ignores=[]),
        filename,
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    return code


def _is_vllm_import(node: ast.stmt) -> bool:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "vllm"
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "vllm" for alias in node.names)
    return False


def _bind_imports(node: ast.stmt, namespace: dict[str, Any], provided: dict[str, Any]) -> None:
    """Bind the names a vllm import statement would bind, from ``provided``."""
    aliases = node.names if isinstance(node, (ast.Import, ast.ImportFrom)) else []
    for alias in aliases:
        name = alias.asname or alias.name.split(".")[0]
        if alias.name not in provided:
            raise LookupError(
                f"{ast.unparse(node)[:80]!r}: no stand-in for {alias.name!r}; "
                "this vLLM version imports something new"
            )
        namespace[name] = provided[alias.name]


def _defined_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id] if node.value is not None else []
    return []


def _pool_imports(version: str) -> list[str]:
    """The names block_pool.py imports from kv_cache_utils.py."""
    tree = ast.parse(vllm_source.vllm_file(version, POOL_FILE))
    return [
        alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module == UTILS
        for alias in node.names
    ]


def _load_utils(version: str) -> types.ModuleType:
    """What block_pool.py imports from kv_cache_utils.py, and its helpers, from the wheel."""
    required = set(_pool_imports(version)) | {"hash_block_tokens"}
    wanted_names = required | set(UTILS_HELPERS)
    tree = ast.parse(vllm_source.vllm_file(version, UTILS_FILE))
    module = types.ModuleType(UTILS)
    namespace = module.__dict__
    namespace.update(__file__=UTILS_FILE)
    provided = _stand_ins()
    stdlib: list[ast.stmt] = []
    wanted: list[ast.stmt] = []
    found: set[str] = set()
    for node in tree.body:
        if _is_vllm_import(node):
            _bind_imports_lenient(node, namespace, provided)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            stdlib.append(node)
        elif names := [n for n in _defined_names(node) if n in wanted_names]:
            wanted.append(node)
            found.update(names)
    missing = required - found
    if missing:
        raise LookupError(f"vllm {version} {UTILS_FILE} lacks {sorted(missing)}")
    # @dataclass resolves string annotations in sys.modules[cls.__module__]: register briefly.
    saved = sys.modules.get(UTILS)
    sys.modules[UTILS] = module
    try:
        exec(_compile(stdlib + wanted, version, UTILS_FILE), namespace)
    finally:
        if saved is None:
            del sys.modules[UTILS]
        else:
            sys.modules[UTILS] = saved
    # hash_block_tokens reads the seed hash of a prefix chain; any fixed value will do here.
    namespace["NONE_HASH"] = vllm_sha256("kvqueue-bench-none-hash")
    return module


def _bind_imports_lenient(
    node: ast.stmt, namespace: dict[str, Any], provided: dict[str, Any]
) -> None:
    # kv_cache_utils imports much that the loaded parts never touch: bind what we have.
    aliases = node.names if isinstance(node, (ast.Import, ast.ImportFrom)) else []
    for alias in aliases:
        if alias.name in provided:
            namespace[alias.asname or alias.name] = provided[alias.name]


def _load_pool(version: str, utils: types.ModuleType) -> types.ModuleType:
    """block_pool.py, whole, with its vllm imports bound to stand-ins and ``utils``."""
    tree = ast.parse(vllm_source.vllm_file(version, POOL_FILE))
    module = types.ModuleType(POOL)
    namespace = module.__dict__
    namespace.update(__file__=POOL_FILE)
    provided = {**_stand_ins(), **vars(utils)}
    body: list[ast.stmt] = []
    for node in tree.body:
        if _is_vllm_import(node):
            _bind_imports(node, namespace, provided)
        else:
            body.append(node)
    exec(_compile(body, version, POOL_FILE), namespace)
    for name in ("BlockPool", "BlockHashToBlockMap"):
        if not isinstance(namespace.get(name), type):
            raise LookupError(f"vllm {version} {POOL_FILE} defines no {name}")
    return module


@dataclass
class Engine:
    """One vLLM version's block pool and its kv_cache_utils, as live modules."""

    version: str
    kv_cache_utils: types.ModuleType
    block_pool: types.ModuleType

    @property
    def KVCacheBlock(self) -> type:
        block_class: type = self.kv_cache_utils.KVCacheBlock
        return block_class

    @property
    def vllm_queue(self) -> type:
        queue_class: type = self.kv_cache_utils.FreeKVCacheBlockQueue
        return queue_class

    @property
    def BlockPool(self) -> type:
        pool_class: type = self.block_pool.BlockPool
        return pool_class

    def use_queue(self, queue_class: Callable[..., Any]) -> None:
        """Make ``BlockPool(...)`` build ``queue_class`` (as kvqueue.vllm.install does)."""
        setattr(self.block_pool, "FreeKVCacheBlockQueue", queue_class)  # noqa: B010

    def queue_in_use(self) -> type:
        """The class of the queue a pool built now would hold (kvqueue.vllm binds a
        stand-in to vLLM's name, which builds kvqueue's queue)."""
        return type(self.block_pool.FreeKVCacheBlockQueue([]))

    @contextmanager
    def in_sys_modules(self) -> Iterator[None]:
        """Register the tree as ``vllm``, ``vllm.v1``, ``vllm.v1.core`` and its two modules."""
        vllm = types.ModuleType("vllm")
        vllm.__version__ = self.version  # type: ignore[attr-defined]
        tree = {
            "vllm": vllm,
            "vllm.v1": types.ModuleType("vllm.v1"),
            "vllm.v1.core": types.ModuleType("vllm.v1.core"),
            UTILS: self.kv_cache_utils,
            POOL: self.block_pool,
        }
        saved = {name: sys.modules.get(name) for name in tree}
        sys.modules.update(tree)
        try:
            yield
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module


@cache
def load_engine(version: str = "0.33.0") -> Engine:
    """vLLM ``version``'s BlockPool with its own queue (see :meth:`Engine.use_queue`)."""
    utils = _load_utils(version)
    return Engine(version, utils, _load_pool(version, utils))
