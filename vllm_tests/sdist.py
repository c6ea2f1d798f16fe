"""vLLM's own test files for one release, from its sdist on the package index; print their root.

``python vllm_tests/sdist.py [VERSION]`` (default: ``VLLM_VERSION`` of vllm.env) prints a
directory holding the sdist's ``tests/``, ``examples/`` (scripts some tests load) and
``pyproject.toml`` (vLLM's pytest configuration) and nothing else of it: with ``vllm/`` left
out, ``import vllm`` in the tests finds the installed wheel, not the sdist's source tree.

The file is found through pip's configured index (``index-url`` from pip's own configuration,
environment included; pip's default otherwise) with the simple repository API (PEP 691 JSON),
checked against the sha256 the index gives, and kept under the cache root (``cache_dir()``:
``$KVQUEUE_CI_CACHE``, default ``$XDG_CACHE_HOME/kvqueue`` or ``~/.cache/kvqueue``).
``pip download --no-binary`` is not used: it builds vLLM's metadata, which needs its build
requirements and may name the result ``X.Y.Z+empty``.

Raises ``LookupError`` when the index lists no sdist of that version, ``ValueError`` on a hash
mismatch, ``urllib.error.URLError`` when the index cannot be reached.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

PROJECT = "vllm"
PINS = Path(__file__).resolve().parent / "vllm.env"
KEPT = ("tests/", "examples/", "pyproject.toml")
_COMPLETE = ".complete"


def pins() -> dict[str, str]:
    """vllm.env's ``NAME=value`` lines (``VLLM_VERSION``, ``TORCH_VERSION``)."""
    lines = PINS.read_text(encoding="utf-8").splitlines()
    pairs = (line.partition("=") for line in lines if line.strip() and not line.startswith("#"))
    return {name.strip(): value.strip() for name, _, value in pairs}


VLLM_VERSION = pins()["VLLM_VERSION"]


def cache_dir() -> Path:
    """The one cache root of kvqueue's checks and benchmarks (.ci/common.sh says the same)."""
    explicit = os.environ.get("KVQUEUE_CI_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvqueue"


def index_url() -> str:
    """pip's ``index-url`` as pip itself would resolve it (env > command section > global)."""
    from pip._internal.configuration import Configuration
    from pip._internal.models.index import PyPI

    config = Configuration(isolated=False)
    config.load()
    values = dict(config.items())
    for key in (":env:.index-url", "download.index-url", "global.index-url"):
        if values.get(key):
            return str(values[key]).split()[0]
    return str(PyPI.simple_url)


def find_sdist(version: str) -> tuple[str, str, str]:
    """(filename, url, sha256) of ``vllm-VERSION.tar.gz`` on pip's index."""
    page = index_url().rstrip("/") + f"/{PROJECT}/"
    request = urllib.request.Request(
        page, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        listing = json.load(response)
    wanted = f"{PROJECT}-{version}.tar.gz"
    for entry in listing.get("files", []):
        if entry.get("filename") == wanted:
            url = urllib.parse.urljoin(page, entry["url"])
            return wanted, url, entry.get("hashes", {}).get("sha256", "")
    raise LookupError(f"{page} lists no {wanted}")


def download(version: str) -> Path:
    """The sdist file, downloaded once into ``<cache>/sdists/``."""
    target_dir = cache_dir() / "sdists"
    existing = target_dir / f"{PROJECT}-{version}.tar.gz"
    if existing.is_file():
        return existing
    name, url, sha256 = find_sdist(version)
    target_dir.mkdir(parents=True, exist_ok=True)
    print(f"sdist.py: downloading {name}", file=sys.stderr)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target_dir, delete=False) as tmp:
        try:
            with urllib.request.urlopen(url, timeout=600) as response:
                while chunk := response.read(1 << 20):
                    digest.update(chunk)
                    tmp.write(chunk)
            if sha256 and digest.hexdigest() != sha256:
                raise ValueError(f"{name}: sha256 {digest.hexdigest()}, index says {sha256}")
        except BaseException:
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, target_dir / name)
    return target_dir / name


def tests_root(version: str) -> Path:
    """A directory with the sdist's KEPT parts, extracted once (again when KEPT changes)."""
    prefix = f"{PROJECT}-{version}/"

    def extract(staging: Path) -> None:
        with tarfile.open(download(version)) as archive:
            members = []
            for member in archive.getmembers():
                if not member.name.startswith(prefix):
                    continue
                rel = member.name[len(prefix) :]
                if rel in KEPT or rel.startswith(tuple(k for k in KEPT if k.endswith("/"))):
                    member.name = rel
                    members.append(member)
            archive.extractall(staging, members, filter="data")

    return made_once(cache_dir() / f"vllm-{version}-tests", f"{' '.join(KEPT)}\n", extract)


def made_once(root: Path, marker: str, fill: Callable[[Path], None]) -> Path:
    """``root``, unless it is complete and made by ``marker``'s recipe, made again by
    ``fill`` in a staging directory beside it, then renamed: an interrupted fill leaves no
    half-made ``root`` behind. Processes that ask at once (pytest's workers) fill it once:
    the others wait on a lock beside it, then find it made, never removed under them."""
    complete = root / _COMPLETE

    def made() -> bool:
        return complete.is_file() and complete.read_text(encoding="utf-8") == marker

    if made():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if made():
            return root
        staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
        try:
            fill(staging)
            (staging / _COMPLETE).write_text(marker, encoding="utf-8")
            shutil.rmtree(root, ignore_errors=True)
            staging.rename(root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return root


if __name__ == "__main__":
    print(tests_root(sys.argv[1] if len(sys.argv) > 1 else VLLM_VERSION))
