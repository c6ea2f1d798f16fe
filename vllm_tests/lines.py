"""One vLLM venv for every accepted line: an older line's Python laid over the newest's venv.

The venv of vllm_tests/venv.sh holds the newest line (``VLLM_VERSION`` of vllm.env) with its
requirements and the CPU torch. For any other line of ``kvqueue.vllm._lines.LINES``, that
line's wheel (downloaded once into ``<cache>/wheels``) is unpacked into
``<cache>/vllm-<release>-overlay`` without its compiled ``.so`` files (CUDA kernels that the
CPU path does not load) and with its ``vllm-<release>.dist-info``, versioned
``<release>+cpu`` as vLLM's own CPU builds are (0.23-0.27 choose the CPU platform by that
suffix alone; later lines also by ``VLLM_TARGET_DEVICE``); that directory first on
``PYTHONPATH`` makes ``import vllm`` and ``importlib.metadata.version("vllm")`` that line's,
over the same torch and the same requirements. One venv, one download cache, for all lines.
What the line requires and the venv lacks altogether (0.23's ``gguf``, say) is installed into
the overlay too, without its dependencies (those must be the venv's: checked); a requirement
the venv holds at another version is said, not changed (the line's suites tell whether it
matters).

``python lines.py LINE`` prints the ``PYTHONPATH`` entry for LINE (``0.31``, ``0.31.0``; empty
for the venv's own line), ``--list`` the accepted releases, ``--ci`` the ones CI runs (one
line per row of lines alike, ``rows()``, the oldest and the newest line included), ``--demo``
the ones CI runs the demo of form A on (the oldest). All of them from the lines' table.
"""

from __future__ import annotations

import argparse
import compileall
import hashlib
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import PackageNotFoundError, distributions, version
from pathlib import Path

import sdist
from packaging.requirements import Requirement
from requirements import needed

from kvqueue.vllm._lines import LINES, Line, accepted, find

NEWEST = LINES[-1]


def line(spec: str) -> Line:
    """The accepted line a ``0.31`` / ``0.31.0`` names (SystemExit naming the accepted ones)."""
    found = find(spec if spec.count(".") >= 2 else spec + ".0")
    if found is None:
        raise SystemExit(f"vLLM {spec} is not an accepted line ({accepted()})")
    if spec.count(".") >= 2 and spec != found.release:
        raise SystemExit(f"vLLM {spec}: the line {found.name} is proven on {found.release}")
    return found


def rows() -> list[list[Line]]:
    """The lines grouped by what the guard and the tests see alike: the block's fields, the
    guarded pool methods, how ``free_blocks`` counts, null skipping, how a block names its
    pool and the torch pinned. (The queue's methods are left out: ``iter_blocks_after``, new
    in 0.26, is a query.)"""
    groups: dict[tuple[object, ...], list[Line]] = {}
    for each in LINES:
        key = (each.block_fields, tuple(each.pool_methods.items()), each.counts_first,
               each.skips_null, each.weak_pool, each.torch)  # fmt: skip
        groups.setdefault(key, []).append(each)
    return list(groups.values())


def ci_lines() -> list[Line]:
    """The newest line of each row (it has every method of its row, and the most tests),
    but the oldest line accepted for its own row (a row's lines are alike: one run of that
    row keeps CI's time bounded), in the table's order."""
    chosen = {id(group[0] if group[0] is LINES[0] else group[-1]) for group in rows()}
    return [each for each in LINES if id(each) in chosen]


def demo_lines() -> list[Line]:
    """The lines CI runs the live demo of form A on: the oldest. The newest, the venv's own,
    runs form A three ways in test_live_engine.py, and CI demos form D on it."""
    return [LINES[0]]


def venv_release() -> str:
    """The vLLM release installed in this interpreter's venv (site-packages, not an overlay)."""
    found = list(distributions(name="vllm", path=[sysconfig.get_path("purelib")]))
    if not found:
        raise SystemExit("no vLLM installed in this interpreter's venv (vllm_tests/venv.sh)")
    return found[0].version


def wheel(release: str) -> Path:
    """The line's wheel in ``<cache>/wheels``, downloaded once with the machine's pip."""
    wheels = sdist.cache_dir() / "wheels"
    found = sorted(wheels.glob(f"vllm-{release}-*.whl"))
    if not found:
        print(f"lines.py: downloading the vllm {release} wheel", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
             "--only-binary=:all:", "-d", str(wheels), f"vllm=={release}"],
            check=True,
        )  # fmt: skip
        found = sorted(wheels.glob(f"vllm-{release}-*.whl"))
    return found[-1]


def overlay(target: Line) -> Path | None:
    """The directory to put first on ``PYTHONPATH`` for ``target`` (made once), or None when
    the venv's own vLLM is that line."""
    if target.release == venv_release():
        return None
    root = sdist.cache_dir() / f"vllm-{target.release}-overlay"
    source = wheel(target.release)
    # Made again when the wheel or this recipe (this file, requirements.py) changes.
    recipe = hashlib.sha256(
        Path(__file__).read_bytes() + Path(needed.__code__.co_filename).read_bytes()
    )
    marker = f"{source.name} {recipe.hexdigest()}\n"

    def fill(staging: Path) -> None:
        with zipfile.ZipFile(source) as archive:
            for name in archive.namelist():
                if not name.endswith(".so"):
                    archive.extract(name, staging)
        mark_cpu(target, staging)
        install_missing(target, staging)
        # Compiled once, for python and python -O (some of vLLM's tests run a -O child with a
        # timeout), as pip compiles an installed wheel; tracebacks name the overlay's files.
        compileall.compile_dir(staging, ddir=str(root), quiet=1, optimize=[0, 1], workers=0)

    return sdist.made_once(root, marker, fill)


def mark_cpu(target: Line, directory: Path) -> None:
    """Version the overlay's dist-info ``<release>+cpu``, as vLLM names its CPU builds."""
    (metadata,) = directory.glob("vllm-*.dist-info/METADATA")
    text = metadata.read_text(encoding="utf-8")
    stated = f"\nVersion: {target.release}\n"
    if stated not in text:
        raise SystemExit(f"lines.py: {metadata} does not say {stated.strip()}")
    metadata.write_text(text.replace(stated, f"\nVersion: {target.release}+cpu\n", 1), "utf-8")


def requirements_of(target: Line, directory: Path) -> list[Requirement]:
    """The line's requirements for the CPU (its dist-info in ``directory``)."""
    (dist,) = distributions(name="vllm", path=[str(directory)])
    return needed(dist.requires or [])


def installed(name: str) -> str | None:
    """The version of ``name`` this interpreter imports, or None."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def install_missing(target: Line, directory: Path) -> None:
    """Put into ``directory`` what the line requires and the venv has not at all; say which
    requirements the venv holds at another version."""
    missing = []
    for req in requirements_of(target, directory):
        have = installed(req.name)
        if have is None:
            missing.append(req)
        elif not req.specifier.contains(have, prereleases=True):
            print(f"lines.py: vLLM {target.release} names {req}; the venv has {have}",
                  file=sys.stderr)  # fmt: skip
    if not missing:
        return
    print(f"lines.py: vLLM {target.release} needs {', '.join(map(str, missing))}", file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(directory),
         *map(str, missing)],
        check=True,
    )  # fmt: skip
    # Their own requirements must be in the venv already (--no-deps put nothing else here).
    for req in missing:
        (dist,) = distributions(name=req.name, path=[str(directory)])
        lacking = [str(sub) for sub in needed(dist.requires or []) if installed(sub.name) is None]
        if lacking:
            raise SystemExit(f"lines.py: {req.name} needs {', '.join(lacking)}, not in the venv")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("line", nargs="?", help="0.31 or 0.31.0: print its PYTHONPATH entry")
    group.add_argument("--list", action="store_true", help="every accepted release")
    group.add_argument("--ci", action="store_true", help="the releases CI runs")
    group.add_argument("--demo", action="store_true", help="the releases CI demos")
    args = parser.parse_args()
    if args.list or args.ci or args.demo:
        chosen = ci_lines() if args.ci else demo_lines() if args.demo else LINES
        print(" ".join(each.release for each in chosen))
        return 0
    path = overlay(line(args.line))
    print(path or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
