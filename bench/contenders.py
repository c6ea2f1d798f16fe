"""The queues of the microbenchmark, all threading the same ``kvqueue.KVCacheBlock`` class.

vLLM's ``FreeKVCacheBlockQueue`` is read from vLLM's sdist (the one ``make vllm-tests`` takes
its tests from, vllm_tests/sdist.py; nothing of vLLM is committed here): its one file is
extracted once under ``<cache root>/vllm-<version>-src/`` and the class exec'd alone.
``pure@REV`` / ``cython@REV`` are the twins at git revision REV: ``src/kvqueue`` there,
renamed ``kvqueue_base`` and compiled in place under ``<cache root>/baseline/<commit>`` with
the benchmark's own Cython (another would time two Cython releases as well as two kvqueues).
"""

from __future__ import annotations
import __future__

import ast
import importlib
import importlib.machinery
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

from kvqueue import KVCacheBlock

REPOSITORY = Path(__file__).resolve().parent.parent
sys.path.append(str(REPOSITORY / "vllm_tests"))
import sdist  # noqa: E402  (vllm_tests/sdist.py: the cache root, the pin, the download)

QUEUE_FILE = "vllm/v1/core/kv_cache_utils.py"


# vLLM 0.30.0 is the seed's baseline: every ratio is taken against it. Beside it, the release
# vllm_tests/vllm.env pins (newer ones have a local-variable / single-block fast path).
REFERENCE, PINNED = "vllm-0.30", "vllm-" + ".".join(sdist.VLLM_VERSION.split(".")[:2])
VLLM_VERSIONS = {REFERENCE: "0.30.0", PINNED: sdist.VLLM_VERSION}
# With no vLLM (--quick), ratios are taken against the pure twin instead.
FALLBACK_REFERENCE = "pure"
# The C floor, with no O(1) ``remove``: each case spells out its own deque cycle.
DEQUE = "deque"
ALL = (*VLLM_VERSIONS, "pure", "cython", DEQUE)
QUICK = ("pure", "cython", DEQUE)
TWINS = {"pure": "_queue_py", "cython": "_queue"}


def load(name: str) -> type:
    """The queue class of contender ``name`` (``collections.deque`` for the deque); LookupError
    (with the reason) when it cannot be had."""
    if name == DEQUE:
        return deque
    twin, at, rev = name.partition("@")
    if twin in TWINS:
        module = _baseline_module(rev, TWINS[twin]) if at else f"kvqueue.{TWINS[twin]}"
        try:
            queue_class: type = importlib.import_module(module).FreeKVCacheBlockQueue
        except ImportError as exc:
            raise LookupError(f"{module} is not importable ({exc})") from exc
        return queue_class
    return _vllm_queue(VLLM_VERSIONS[name])


def _vllm_queue(version: str) -> type:
    """vLLM's class alone, exec'd in a fresh namespace with ``KVCacheBlock`` bound to kvqueue's
    (annotations not evaluated)."""
    path = sdist.cache_dir() / f"vllm-{version}-src" / QUEUE_FILE
    if not path.is_file():
        try:
            archive = sdist.download(version)
        except OSError as exc:  # offline: the run goes on without this contender
            raise LookupError(f"vllm {version}'s sdist: {exc}") from exc
        with tarfile.open(archive) as tar:  # KeyError (a LookupError) if the file is missing
            text = tar.extractfile(f"vllm-{version}/{QUEUE_FILE}").read()  # type: ignore[union-attr]
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole, then renamed: an interrupted write leaves no half file behind.
        partial = path.with_suffix(".partial")
        partial.write_bytes(text)
        partial.replace(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes: list[ast.stmt] = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FreeKVCacheBlockQueue"
    ]
    if not nodes:
        raise LookupError(f"vllm {version} {QUEUE_FILE} defines no FreeKVCacheBlockQueue")
    # The real path as file name: tracebacks and profilers then show vLLM's own lines.
    code = compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)  # fmt: skip
    namespace: dict[str, Any] = {"__name__": f"vllm_{version.replace('.', '_')}",
                                 "KVCacheBlock": KVCacheBlock}  # fmt: skip
    exec(code, namespace)
    loaded: type = namespace["FreeKVCacheBlockQueue"]
    return loaded


# -- kvqueue at an older revision, importable beside today's

BASE = "kvqueue_base"
# Absolute imports of the package itself: ``from kvqueue... import`` and ``import kvqueue``.
_FROM = re.compile(r"^(\s*from )kvqueue(?=[.\s])", re.MULTILINE)
_IMPORT = re.compile(r"^(\s*import )kvqueue$", re.MULTILINE)
# ``cdef public class ... [object KvqQueueObject, type KvqQueueType]`` exports these C names
# from each extension; distinct names keep the two builds from ever meeting at link time.
_C_NAMES = re.compile(r"\bKvqQueue(?=Object|Type)")


def _git(*args: str) -> bytes:
    proc = subprocess.run(["git", "-C", str(REPOSITORY), *args], capture_output=True, check=False)
    if proc.returncode:
        raise LookupError(f"git {' '.join(args)}: {proc.stderr.decode().strip()}")
    return proc.stdout


def resolve(rev: str) -> str:
    """The short commit hash of ``rev``; LookupError if git does not know it."""
    return _git("rev-parse", "--short", "--verify", f"{rev}^{{commit}}").decode().strip()


def _extract(commit: str, root: Path) -> None:
    """``src/kvqueue`` at ``commit`` as ``root/kvqueue_base``, its imports rewritten."""
    archive = _git("archive", "--format=tar", f"{commit}:src/kvqueue")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root / BASE, filter="data")
    for path in (root / BASE).rglob("*.py*"):  # .py, .pyx, .pyi
        text = _FROM.sub(rf"\g<1>{BASE}", path.read_text(encoding="utf-8"))
        text = _IMPORT.sub(rf"\g<1>{BASE} as kvqueue", text)
        path.write_text(_C_NAMES.sub("KvqBaseQueue", text), encoding="utf-8")


def _baseline_module(rev: str, name: str) -> str:
    """Make ``kvqueue_base`` at ``rev`` importable (built once, about half a minute); the full
    name of its module ``name``."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    root = sdist.cache_dir() / "baseline" / commit
    if not (root / BASE / f"_queue{importlib.machinery.EXTENSION_SUFFIXES[0]}").is_file():
        if not (root / BASE).is_dir():
            # Staged, then renamed: an interrupted extraction leaves no half package behind
            # (the staging directory, renamed away, is no error to clean up).
            root.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=root.parent, ignore_cleanup_errors=True) as tmp:
                _extract(commit, Path(tmp))
                Path(tmp).rename(root)
        print(f"baseline: building kvqueue {rev} in {root} ...", file=sys.stderr)
        cythonize = [sys.executable, "-m", "Cython.Build.Cythonize", "-i", "-q", "-3"]
        subprocess.run(
            [*cythonize, f"{BASE}/_queue.pyx"], cwd=root, stdout=subprocess.DEVNULL, check=True
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return f"{BASE}.{name}"
