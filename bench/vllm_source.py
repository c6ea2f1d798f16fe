"""vLLM's own ``FreeKVCacheBlockQueue``, read from vLLM's sdist at run time (nothing of vLLM is
committed here) and exec'd alone, threading whatever block class it is given.

The sdist is the one ``make vllm-tests`` takes its tests from (vllm_tests/sdist.py: found on
pip's index, checked against its sha256, downloaded once into the cache root); the one file
needed is extracted once beside it, under ``<cache root>/vllm-<version>-src/``.
"""

from __future__ import annotations
import __future__

import ast
import sys
import tarfile
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

QUEUE_FILE = "vllm/v1/core/kv_cache_utils.py"
_VLLM_TESTS = Path(__file__).resolve().parent.parent / "vllm_tests"


def sdist() -> ModuleType:
    """vllm_tests/sdist.py: the cache root, the pinned version, the sdist's download."""
    if str(_VLLM_TESTS) not in sys.path:
        sys.path.append(str(_VLLM_TESTS))
    import sdist as module

    return module


def _path(version: str) -> Path:
    return Path(sdist().cache_dir()) / f"vllm-{version}-src" / QUEUE_FILE


def is_cached(version: str) -> bool:
    return _path(version).is_file()


def source(version: str) -> str:
    """The text of QUEUE_FILE in the ``vllm==version`` sdist (downloaded once)."""
    path = _path(version)
    if not path.is_file():
        archive = sdist().download(version)
        with tarfile.open(archive) as tar:
            member = tar.extractfile(f"vllm-{version}/{QUEUE_FILE}")
            if member is None:
                raise LookupError(f"{archive} holds no {QUEUE_FILE}")
            text = member.read()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_bytes(text)
        partial.replace(path)
    return path.read_text(encoding="utf-8")


@cache
def load_queue_class(version: str, block_class: type) -> type:
    """vLLM ``version``'s ``FreeKVCacheBlockQueue``, its definition alone exec'd in a fresh
    namespace with ``KVCacheBlock`` bound to ``block_class`` (annotations not evaluated)."""
    tree = ast.parse(source(version))
    nodes = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FreeKVCacheBlockQueue"
    ]
    if not nodes:
        raise LookupError(f"vllm {version} {QUEUE_FILE} defines no FreeKVCacheBlockQueue")
    module = ast.Module(body=nodes, type_ignores=[])
    # The real path as file name: tracebacks and profilers then show vLLM's own lines.
    code = compile(module, str(_path(version)), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)  # fmt: skip
    namespace: dict[str, Any] = {"__name__": f"vllm_{version.replace('.', '_')}",
                                 "KVCacheBlock": block_class}  # fmt: skip
    exec(code, namespace)
    loaded: type = namespace["FreeKVCacheBlockQueue"]
    return loaded
