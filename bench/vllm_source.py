"""vLLM's own code, read at run time from the published wheel; nothing of it is committed here.

Public API (stable: the benchmark and the engine-integration tests import it):

``vllm_file(version, relpath) -> str``
    The source text of the file at ``relpath`` inside the ``vllm==version`` wheel, e.g.
    ``vllm_file("0.30.0", "vllm/v1/core/kv_cache_utils.py")``. Only ``.py`` files are kept.

``load_class(version, relpath, class_name, names) -> type``
    The top-level class ``class_name`` of that file, its definition taken with ``ast`` and
    exec'd alone in a fresh namespace pre-filled with ``names``. Nothing else of the module
    runs, so vLLM's imports need not resolve; a name the class needs at call time must be in
    ``names``. Annotations are not evaluated (as under ``from __future__ import annotations``).

``load_queue_class(version, block_class) -> type``
    vLLM's ``FreeKVCacheBlockQueue`` with ``KVCacheBlock`` bound to ``block_class``.

``is_cached(version) -> bool``
    Whether ``version`` can be loaded without a download.

The first use of a version runs ``pip download --no-deps vllm==VERSION`` (the wheel is
about 340 MB), extracts every ``.py`` file of it (about 40 MB) under the cache directory and
deletes the wheel. The cache is ``$KVQUEUE_BENCH_CACHE``, else
``$XDG_CACHE_HOME/kvqueue-bench``, else ``~/.cache/kvqueue-bench``. A wheel already put in
``<cache>/wheels/`` is used instead of downloading.

From the repository root: ``sys.path.insert(0, "bench")`` then ``import vllm_source``.
"""

from __future__ import annotations
import __future__

import ast
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ("cache_dir", "is_cached", "load_class", "load_queue_class", "vllm_file")

QUEUE_FILE = "vllm/v1/core/kv_cache_utils.py"
# Every host loads the same source: the Python files do not differ between platform wheels,
# so pin one platform that every release publishes instead of the host's.
WHEEL_PLATFORM = "manylinux_2_28_x86_64"
_COMPLETE = ".complete"


def cache_dir() -> Path:
    explicit = os.environ.get("KVQUEUE_BENCH_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvqueue-bench"


def _source_dir(version: str) -> Path:
    return cache_dir() / f"vllm-{version}"


def is_cached(version: str) -> bool:
    return (_source_dir(version) / _COMPLETE).is_file()


def vllm_file(version: str, relpath: str) -> str:
    """The text of ``relpath`` (e.g. ``vllm/v1/core/block_pool.py``) in the vllm wheel."""
    if not is_cached(version):
        _fetch(version)
    path = _source_dir(version) / relpath
    if not path.is_file():
        raise FileNotFoundError(f"{relpath} is not a .py file of the vllm {version} wheel")
    return path.read_text(encoding="utf-8")


def load_class(version: str, relpath: str, class_name: str, names: dict[str, Any]) -> type:
    """Class ``class_name`` of ``relpath``, exec'd alone with ``names`` as its globals."""
    source = vllm_file(version, relpath)
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            break
    else:
        raise LookupError(f"vllm {version} {relpath} defines no top-level class {class_name}")
    module = ast.Module(body=[node], type_ignores=[])
    # The real path as file name: tracebacks and profilers then show vLLM's own lines.
    filename = str(_source_dir(version) / relpath)
    code = compile(
        module, filename, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True
    )
    namespace = {"__name__": f"vllm_{version.replace('.', '_')}", **names}
    exec(code, namespace)
    loaded = namespace[class_name]
    loaded.__vllm_version__ = version
    return loaded


@cache
def load_queue_class(version: str, block_class: type) -> type:
    """vLLM ``version``'s ``FreeKVCacheBlockQueue``, building ``block_class`` blocks."""
    return load_class(version, QUEUE_FILE, "FreeKVCacheBlockQueue", {"KVCacheBlock": block_class})


def _fetch(version: str) -> None:
    wheels = cache_dir() / "wheels"
    wheel = _find_wheel(wheels, version)
    if wheel is None:
        wheels.mkdir(parents=True, exist_ok=True)
        print(f"vllm_source: downloading vllm {version} (about 340 MB) ...", file=sys.stderr)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                f"--platform={WHEEL_PLATFORM}",
                f"vllm=={version}",
                "-d",
                str(wheels),
            ],
            check=True,
        )
        wheel = _find_wheel(wheels, version)
        if wheel is None:
            raise FileNotFoundError(f"pip download left no vllm {version} wheel in {wheels}")
    _extract(wheel, _source_dir(version))
    wheel.unlink()


def _find_wheel(wheels: Path, version: str) -> Path | None:
    found = sorted(wheels.glob(f"vllm-{version}-*.whl")) if wheels.is_dir() else []
    return found[0] if found else None


def _extract(wheel: Path, target: Path) -> None:
    """Extract the wheel's .py files into ``target``, atomically (a crash leaves no half)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.endswith(".py")]
            archive.extractall(staging, members)
        (staging / _COMPLETE).write_text(wheel.name + "\n", encoding="utf-8")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
