"""Print pyproject.toml's [build-system] requires (``--test``: the test extra instead),
space-separated, for ``pip install``.

Used where kvqueue is built without pip's build isolation (the benchmark's venv, so that the
Cython it records is the one that built the timed module; the memory checks) and where the
build requirements are fetched ahead of an offline build (wheels.sh, py314.sh); the test
extra wherever the suite runs against a built wheel, so that it runs with what make test has.
Usage: python .ci/build_requires.py [--test] [PYPROJECT]   (default: the repository's)
"""

import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
args = sys.argv[1:]
test = args[:1] == ["--test"]
path = Path(args[test]) if len(args) > test else ROOT / "pyproject.toml"
project = tomllib.loads(path.read_text(encoding="utf-8"))
found = project["project"]["optional-dependencies"]["test"] if test else None
print(" ".join(found or project["build-system"]["requires"]))
