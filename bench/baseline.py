"""kvqueue as it was at an older git revision, importable beside today's in one process.

``run.py --baseline REV`` times ``pure@REV`` and ``cython@REV`` next to today's twins. The
package's ``src/kvqueue`` at REV is taken with ``git archive``, renamed ``kvqueue_base``
(its absolute imports rewritten to match) and compiled in place with Cython under
``<cache root>/baseline/<commit>``, which later runs reuse. Building needs Cython and a
C compiler in the benchmark's interpreter; use the Cython that built today's twin, or the
comparison times two Cython releases as well as two versions of kvqueue.
"""

from __future__ import annotations

import importlib.machinery
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import vllm_source

PACKAGE = "kvqueue_base"
REPOSITORY = Path(__file__).resolve().parent.parent
SOURCE = "src/kvqueue"
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


def _rewrite(text: str) -> str:
    text = _FROM.sub(rf"\g<1>{PACKAGE}", text)
    text = _IMPORT.sub(rf"\g<1>{PACKAGE} as kvqueue", text)
    return _C_NAMES.sub("KvqBaseQueue", text)


def _extract(commit: str, root: Path) -> None:
    """``src/kvqueue`` at ``commit`` as ``root/kvqueue_base``, its imports rewritten."""
    archive = _git("archive", "--format=tar", f"{commit}:{SOURCE}")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            target = root / PACKAGE / member.name
            target.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            if target.suffix in (".py", ".pyx", ".pyi"):
                data = _rewrite(data.decode("utf-8")).encode("utf-8")
            target.write_bytes(data)


def build(rev: str) -> Path:
    """The directory to put on ``sys.path`` for ``kvqueue_base`` at ``rev``, built if need be.

    Raises LookupError for an unknown revision and subprocess.CalledProcessError when
    Cython or the compiler fails (its output is on stderr). Reuses an earlier build for
    this interpreter; a first build takes about half a minute.
    """
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    root = vllm_source.sdist().cache_dir() / "baseline" / commit
    extension = root / PACKAGE / f"_queue{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    if extension.is_file():
        return root
    if not (root / PACKAGE).is_dir():
        # Staged, then renamed: an interrupted extraction leaves no half package behind.
        root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
        try:
            _extract(commit, staging)
            staging.rename(root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    print(f"baseline: building kvqueue {rev} in {root} ...", file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "Cython.Build.Cythonize", "-i", "-q", "-3", f"{PACKAGE}/_queue.pyx"],
        cwd=root,
        stdout=subprocess.DEVNULL,
        check=True,
    )
    return root


def module(rev: str, name: str) -> str:
    """Make ``kvqueue_base`` at ``rev`` importable; the full name of its module ``name``."""
    root = str(build(rev))
    if root not in sys.path:
        sys.path.insert(0, root)
    return f"{PACKAGE}.{name}"
