"""Say where the vLLM venv's torch would come from, before anything is installed.

``python torch_source.py VERSION [PIP_ARGS...]`` (vllm_tests/venv.sh runs it with the new venv's
python) asks pip what ``pip install torch==VERSION PIP_ARGS`` would take (``--dry-run
--report``), through the machine's own pip configuration (index, extra indexes, find-links,
environment) plus PIP_ARGS (venv.sh passes ``--extra-index-url $KVQUEUE_TORCH_INDEX`` when
the user sets it). It prints the chosen torch wheel and where it is from. When that is not a
CPU build (no ``+cpu`` local version: on PyPI ``torch==VERSION`` is the CUDA build, with its
NVIDIA packages), it prints what would be downloaded and how much, and exits 3 unless
``KVQUEUE_TORCH_CUDA=1`` says to take it: the user chooses, not this script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

# The packages that come with torch's CUDA build (the names its wheels on PyPI require).
CUDA_PREFIXES = ("nvidia-", "cuda-", "triton")


def size(url: str) -> int | None:
    """The size of the file at ``url`` (a local file, or the server's Content-Length)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = Path(urllib.request.url2pathname(parsed.path))
        return path.stat().st_size if path.is_file() else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as r:
            length = r.headers.get("Content-Length")
    except OSError:
        return None
    return int(length) if length else None


def plan(version: str, pip_args: list[str]) -> list[dict[str, str]]:
    """What pip would install for torch: [{"name", "version", "url"}]."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
             "--report", str(report), f"torch=={version}", *pip_args],
            check=True,
        )  # fmt: skip
        chosen = json.loads(report.read_text(encoding="utf-8"))["install"]
    return [
        {"name": item["metadata"]["name"].lower(), "version": item["metadata"]["version"],
         "url": item["download_info"]["url"]}
        for item in chosen
    ]  # fmt: skip


def main() -> int:
    version, pip_args = sys.argv[1], sys.argv[2:]
    chosen = plan(version, pip_args)
    (torch,) = [item for item in chosen if item["name"] == "torch"]
    where = urllib.parse.urlparse(torch["url"])
    source = where.path.rsplit("/", 1)[0] if where.scheme == "file" else where.netloc
    wheel = urllib.parse.unquote(where.path.rsplit("/", 1)[-1])
    cpu = torch["version"].endswith("+cpu")
    build = "the CPU build" if cpu else "NOT a CPU build"
    print(f"torch_source.py: torch {torch['version']} ({build}): {wheel} from {source}")
    if cpu:
        return 0
    cuda = [
        item for item in chosen if item["name"] == "torch" or item["name"].startswith(CUDA_PREFIXES)
    ]
    sizes = [size(item["url"]) for item in cuda]
    known = sum(s for s in sizes if s)
    unknown = "" if all(sizes) else f" (the size of {sizes.count(None)} unknown)"
    print(
        f"torch_source.py: that is the CUDA build: {len(cuda)} packages "
        f"({', '.join(item['name'] for item in cuda)}), {known / 1e9:.1f} GB to download"
        f"{unknown}. vLLM's CPU path needs none of them.\n"
        "  To take the CPU build: set KVQUEUE_TORCH_INDEX to a package index that serves "
        f"torch {version}+cpu (an extra index for torch alone), or put that wheel where pip's "
        "find-links looks.\n  To take the CUDA build anyway: KVQUEUE_TORCH_CUDA=1."
    )
    return 0 if os.environ.get("KVQUEUE_TORCH_CUDA") == "1" else 3


if __name__ == "__main__":
    sys.exit(main())
