"""Say where the vLLM venv's torch would come from, before anything is installed.

``python torch_source.py VERSION [PIP_ARGS...]`` (vllm_tests/venv.sh runs it with the new venv's
python) asks pip which builds of ``torch==VERSION`` the machine's own pip configuration (index,
extra indexes, find-links, environment) plus PIP_ARGS offers (venv.sh passes
``--extra-index-url $KVQUEUE_TORCH_INDEX`` when the user sets it): ``pip index versions``,
which reads the indexes' listings and downloads no wheel (a dry run of the install fetched the
whole torch wheel, 526 MB, to read its metadata, before it could refuse it). pip takes the CPU
build (``VERSION+cpu``) when one is offered; otherwise the plain ``VERSION``, which on PyPI is
the CUDA build with its NVIDIA packages: then it says what each choice weighs and the two
commands to choose with (PyTorch's CPU index as ``KVQUEUE_TORCH_INDEX``, or
``KVQUEUE_TORCH_CUDA=1``), and exits 3 unless ``KVQUEUE_TORCH_CUDA=1`` says to take the CUDA
build: the user chooses, not this script.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

#: What each build weighs to download (torch 2.13.0 for x86_64 CPython 3.11: the CPU wheel
#: 192 MB; PyPI's CUDA wheel 526 MB, plus about 15 NVIDIA packages of several GB).
CPU_SIZE = "about 0.2 GB"
CUDA_SIZE = "about 0.5 GB plus about 15 NVIDIA packages, several GB"
#: PyTorch's index of CPU builds, as its install instructions give it (pytorch.org, "Start
#: Locally": pip, CPU).
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def offered(pip_args: list[str]) -> list[str]:
    """The versions of torch that pip's configuration plus ``pip_args`` offers, newest first."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "torch", *pip_args],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    for line in listed.splitlines():
        if line.startswith("Available versions:"):
            return [each.strip() for each in line.partition(":")[2].split(",")]
    return []


def main() -> int:
    version, pip_args = sys.argv[1], sys.argv[2:]
    versions = offered(pip_args)
    if f"{version}+cpu" in versions:
        print(f"torch_source.py: torch {version}+cpu, the CPU build ({CPU_SIZE}), is offered")
        return 0
    if version in versions and os.environ.get("KVQUEUE_TORCH_CUDA") == "1":
        print(
            f"torch_source.py: KVQUEUE_TORCH_CUDA=1: torch {version}, the CUDA build (several GB)"
        )
        return 0
    found = "only the CUDA build" if version in versions else "no build"
    said = (
        f"torch_source.py: {found} of torch {version} is offered here (PyPI's is the CUDA build, "
        f"{CUDA_SIZE}; vLLM's CPU path needs none of it). Set one, then run the command again:"
    )
    print(textwrap.fill(said, 100, break_on_hyphens=False))
    print(f"  export KVQUEUE_TORCH_INDEX={CPU_INDEX}   # the CPU build, {CPU_SIZE}")
    print("  export KVQUEUE_TORCH_CUDA=1   # or: the CUDA build")
    return 3


if __name__ == "__main__":
    sys.exit(main())
