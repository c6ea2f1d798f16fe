"""The queues of the microbenchmark, all threading the same ``kvqueue.KVCacheBlock`` class.

vLLM's ``FreeKVCacheBlockQueue`` of each line of ``kvqueue.vllm._lines`` (``vllm-0.23`` ...) is
read from that release's wheel if one is in ``<cache root>/wheels`` (vllm_tests/venv.sh keeps
the pin's there), else from its sdist (the one ``make vllm-tests`` takes its tests from,
vllm_tests/sdist.py): both hold the same file, and nothing of vLLM is committed here. The file
is extracted once under ``<cache root>/vllm-<version>-src/`` and the class exec'd alone.
``pure@REV`` / ``cython@REV`` are the twins at git revision REV: ``src/kvqueue`` there,
renamed ``kvqueue_base``, its queue and the guard's screens compiled in place under
``<cache root>/baseline/<commit>`` with the benchmark's own Cython (another would time two
Cython releases as well as two kvqueues); screens.py takes the screens from there too.
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
import zipfile
from collections import deque
from pathlib import Path
from typing import Any

import sdist  # vllm_tests/sdist.py (the Makefile's PYTHONPATH): the cache root, pin, download

from kvqueue import KVCacheBlock
from kvqueue.vllm._lines import LINES

REPOSITORY = Path(__file__).resolve().parent.parent

QUEUE_FILE = "vllm/v1/core/kv_cache_utils.py"


# vLLM 0.30 is the seed's baseline: every ratio is taken against it. Beside it, the release
# vllm_tests/vllm.env pins (0.32 and later have a local-variable / single-block fast path).
REFERENCE, PINNED = "vllm-0.30", "vllm-" + ".".join(sdist.VLLM_VERSION.split(".")[:2])
# Every line's newest release as _lines has it; the pinned line's, as vllm.env pins it.
VLLM_VERSIONS = {f"vllm-{line.name}": line.release for line in LINES} | {PINNED: sdist.VLLM_VERSION}
# With no vLLM (--quick), ratios are taken against the pure twin instead.
FALLBACK_REFERENCE = "pure"
# The C floor, with no O(1) ``remove``: each case spells out its own deque cycle.
DEQUE = "deque"
ALL = (REFERENCE, PINNED, "pure", "cython", DEQUE)
QUICK = ("pure", "cython", DEQUE)
# --lines: every line's queue against both twins (the deque has no ``remove``).
EVERY_LINE = (*VLLM_VERSIONS, "pure", "cython")
TWINS = {"pure": "_queue_py", "cython": "_queue"}


def load(name: str) -> type:
    """The queue class of contender ``name`` (``collections.deque`` for the deque); LookupError
    (with the reason) when it cannot be had."""
    if name == DEQUE:
        return deque
    twin, at, rev = name.partition("@")
    if twin in TWINS:
        module = baseline_module(rev, TWINS[twin]) if at else f"kvqueue.{TWINS[twin]}"
        try:
            queue_class: type = importlib.import_module(module).FreeKVCacheBlockQueue
        except ImportError as exc:
            raise LookupError(f"{module} is not importable ({exc})") from exc
        return queue_class
    return _vllm_queue(VLLM_VERSIONS[name])


def _queue_file(version: str) -> Path:
    """vLLM ``version``'s ``QUEUE_FILE``, extracted once from its wheel or sdist."""
    path = sdist.cache_dir() / f"vllm-{version}-src" / QUEUE_FILE
    if path.is_file():
        return path
    wheels = sorted((sdist.cache_dir() / "wheels").glob(f"vllm-{version}-*.whl"))
    if wheels:
        with zipfile.ZipFile(wheels[0]) as wheel:  # KeyError (a LookupError) if missing
            text = wheel.read(QUEUE_FILE)
    else:
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
    return path


def _queue_node(version: str) -> tuple[Path, ast.ClassDef]:
    """The file of vLLM ``version``'s queue and the class's syntax tree."""
    path = _queue_file(version)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "FreeKVCacheBlockQueue":
            return path, node
    raise LookupError(f"vllm {version} {QUEUE_FILE} defines no FreeKVCacheBlockQueue")


def _code(function: ast.FunctionDef) -> str:
    """The syntax tree of ``function`` less its docstring: what runs, blank lines, comments
    and docstrings aside (0.31 has 0.30's code with a blank line more in each docstring)."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def same_code(names: list[str], methods: tuple[str, ...]) -> dict[str, str]:
    """For each vLLM contender of ``names``, the first of ``names`` whose queue's ``methods``
    run the same code."""
    firsts: dict[str, str] = {}
    same = {}
    for name in names:
        if name not in VLLM_VERSIONS:
            continue
        _, node = _queue_node(VLLM_VERSIONS[name])
        defs = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
        code = repr([_code(defs[m]) if m in defs else None for m in methods])
        same[name] = firsts.setdefault(code, name)
    return same


def _vllm_queue(version: str) -> type:
    """vLLM's class alone, exec'd in a fresh namespace with ``KVCacheBlock`` bound to kvqueue's
    (annotations not evaluated)."""
    path, node = _queue_node(version)
    # The real path as file name: tracebacks and profilers then show vLLM's own lines.
    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec",
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


# The extensions a baseline builds: the queue (run.py) and the pool guard's screens (screens.py),
# the screens in kvqueue.vllm or, in commits before that subpackage, beside the queue.
COMPILED = ("_queue", "vllm/_screen")


def _compiled(root: Path) -> list[str]:
    """COMPILED as paths under ``root`` without their suffix, as that commit lays them out."""
    return [m if (root / f"{m}.pyx").is_file() else m.rpartition("/")[2] for m in COMPILED]


def baseline_module(rev: str, name: str) -> str:
    """Make ``kvqueue_base`` at ``rev`` importable (built once, about half a minute); the full
    name of its module ``name`` (``"_queue"``, ``"_queue_py"`` or ``"_screen"``, wherever that
    commit has it)."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    root = sdist.cache_dir() / "baseline" / commit
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    built = (root / BASE).is_dir() and all(
        (root / BASE / f"{m}{suffix}").is_file() for m in _compiled(root / BASE)
    )
    if not built:
        if not (root / BASE).is_dir():
            # Staged, then renamed: an interrupted extraction leaves no half package behind
            # (the staging directory, renamed away, is no error to clean up).
            root.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=root.parent, ignore_cleanup_errors=True) as tmp:
                _extract(commit, Path(tmp))
                Path(tmp).rename(root)
        print(f"baseline: building kvqueue {rev} in {root} ...", file=sys.stderr)
        cythonize = [sys.executable, "-m", "Cython.Build.Cythonize", "-i", "-q", "-3"]
        sources = [f"{BASE}/{m}.pyx" for m in _compiled(root / BASE)]
        subprocess.run([*cythonize, *sources], cwd=root, stdout=subprocess.DEVNULL, check=True)
    # Built at run time, installed nowhere: its directory goes on the path so that its modules
    # import one another (``from kvqueue_base import ...``) as the installed kvqueue's do.
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    # A compiled module where that commit has it; the pure twin always beside the package's root.
    found = next((m for m in _compiled(root / BASE) if m.rpartition("/")[2] == name), name)
    return f"{BASE}.{found.replace('/', '.')}"
