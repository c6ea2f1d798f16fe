"""An older vLLM line's Python code, laid over the vLLM venv: how the live engine runs line X.

``python vllm_tests/live/lines.py 0.31.0`` prints a directory holding the Python files and the
``vllm-0.31.0.dist-info`` of that release's wheel (``<cache root>/wheels``, where
``vllm_tests/venv.sh`` keeps the pinned release's wheel), unpacked once and kept: put first on
``PYTHONPATH`` of the vLLM venv, it is the ``vllm`` Python imports (its version included), with
the venv's torch and vLLM's other requirements. The wheel's compiled modules are left out:
the CPU engine with the stub executor never calls them. For the pinned release itself it
prints an empty line: the venv's own vLLM is that release. A wheel not there yet is downloaded
once, as ``venv.sh`` downloads the pinned one. A requirement of the line that the venv
has no distribution of at all (0.23's ``gguf``, ``diskcache``, ...) is installed into the same
directory, without its own dependencies (those the venv has are the ones used).

Run it with the vLLM venv's python: what the venv has decides what is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent.parent
#: CUDA-only requirements of older lines that vllm_tests/requirements.py (which follows the
#: pinned release) does not name: 0.23-0.25's prebuilt FlashInfer kernels (1.8 GB).
OLDER_CUDA_ONLY = {"flashinfer-cubin"}


def cache_root() -> Path:
    """``.ci/common.sh``'s cache root."""
    explicit = os.environ.get("KVQUEUE_CI_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvqueue"


def pinned() -> str:
    """The release ``vllm_tests/vllm.env`` pins: the one the venv itself holds."""
    for line in (ROOT / "vllm_tests" / "vllm.env").read_text(encoding="utf-8").splitlines():
        if line.startswith("VLLM_VERSION="):
            return line.partition("=")[2].strip()
    raise RuntimeError("vllm_tests/vllm.env sets no VLLM_VERSION")


def unpacked(release: str) -> Path:
    """The directory of ``release``'s Python code, unpacked from its wheel on first use."""
    folder = cache_root() / "wheels"
    wheels = sorted(folder.glob(f"vllm-{release}-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "-d", str(folder), f"vllm=={release}"],
            check=True,
        )  # fmt: skip
        wheels = sorted(folder.glob(f"vllm-{release}-*.whl"))
    target = cache_root() / "live-lines" / f"vllm-{release}"
    marker = target / ".ready"
    if marker.is_file() and marker.read_text(encoding="utf-8") == wheels[-1].name:
        return target
    shutil.rmtree(target, ignore_errors=True)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheels[-1]) as wheel:
        names = [n for n in wheel.namelist() if not n.endswith(".so") and ".so." not in n]
        wheel.extractall(partial, names)
    (info,) = partial.glob("vllm-*.dist-info")
    info = _as_cpu_build(info, release)
    missing = absent(Distribution.at(info).requires or [])
    if missing:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial),
             *missing],
            check=True,
        )  # fmt: skip
    # A finished directory or none: a run stopped halfway leaves only the .partial one.
    partial.rename(target)
    marker.write_text(wheels[-1].name, encoding="utf-8")
    return target


def _as_cpu_build(info: Path, release: str) -> Path:
    """Name the release ``X+cpu``, as vLLM's CPU builds are: lines before 0.28 tell the CPU
    platform by that label alone (later ones read ``VLLM_TARGET_DEVICE`` first)."""
    metadata = info / "METADATA"
    text = metadata.read_text(encoding="utf-8")
    metadata.write_text(text.replace(f"\nVersion: {release}\n", f"\nVersion: {release}+cpu\n", 1))
    return info.rename(info.with_name(f"vllm-{release}+cpu.dist-info"))


def absent(requirements: list[str]) -> list[str]:
    """The requirements that apply here (no extra) and that no installed distribution meets
    by name; the venv leaves out the torch family and the CUDA-only packages on purpose."""
    sys.path.insert(0, str(ROOT / "vllm_tests"))
    from requirements import LEFT_OUT, _canonical

    result = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if _canonical(req.name) in LEFT_OUT | OLDER_CUDA_ONLY:
            continue
        try:
            distribution(req.name)
        except PackageNotFoundError:
            result.append(str(req))
    return result


def pythonpath(release: str | None) -> str | None:
    """What goes first on ``PYTHONPATH`` for ``release`` (None: the venv's own vLLM)."""
    if release is None or release == pinned():
        return None
    return str(unpacked(release))


if __name__ == "__main__":
    print(pythonpath(sys.argv[1]) or "")
