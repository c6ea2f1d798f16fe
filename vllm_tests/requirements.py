"""Print vLLM's own requirements for this machine, less those a CPU-only v1 core does without.

Run with the venv's python after ``pip install --no-deps vllm``: the list is read from the
installed distribution's metadata, so it follows the pinned release instead of a copy of it.
Markers are evaluated for this interpreter and platform; extras are dropped. lines.py reads an
older line's wheel with ``needed()`` too.
"""

from __future__ import annotations

from importlib.metadata import requires

from packaging.requirements import Requirement

# torch is installed separately as the CPU build; vision, audio and video decoding are
# not used by the scheduler, the block pool or their tests.
TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}
# Kernels, codecs and loaders built for NVIDIA GPUs: nothing on the CPU path imports them.
CUDA_ONLY = {
    "pynvvideocodec",
    "flashinfer-python",
    "apache-tvm-ffi",
    "tilelang",
    "nvidia-cudnn-frontend",
    "nvtx",
    "fastsafetensors",
    "instanttensor",
    "nvidia-cutlass-dsl",
    "quack-kernels",
    "tokenspeed-mla",
    "humming-kernels",
    "flashinfer-cubin",
}
LEFT_OUT = TORCH_FAMILY | CUDA_ONLY


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def needed(texts: list[str]) -> list[Requirement]:
    """Of a distribution's ``Requires-Dist`` lines, those for this machine and the CPU."""
    wanted = []
    for text in texts:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if _canonical(req.name) not in LEFT_OUT:
            wanted.append(req)
    return wanted


def main() -> None:
    for req in needed(requires("vllm") or []):
        print(req)


if __name__ == "__main__":
    main()
