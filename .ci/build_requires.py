"""Print pyproject.toml's [build-system] requires, space-separated, for ``pip install``.

Used where kvqueue is built without pip's build isolation (the benchmark's venv, so that the
Cython it records is the one that built the timed module; the memory checks) and where the
build requirements are fetched ahead of an offline build (wheels.sh, py314.sh).
Usage: python .ci/build_requires.py [PYPROJECT]   (default: the repository's)
"""

import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "pyproject.toml"
print(" ".join(tomllib.loads(path.read_text(encoding="utf-8"))["build-system"]["requires"]))
