"""Build the compiled twin, unless a pure build is asked for or cannot be had.

``KVQUEUE_PURE=1`` (or a non-CPython interpreter) builds a pure wheel. The
extension is ``optional``: with no working compiler the build still succeeds
and ``import kvqueue`` falls back to the pure twin.
"""

import os
import platform

from setuptools import Extension, setup


def _pure_build() -> bool:
    return os.environ.get("KVQUEUE_PURE", "") not in ("", "0") or (
        platform.python_implementation() != "CPython"
    )


if _pure_build():
    setup()
else:
    from Cython.Build import cythonize

    extensions = cythonize(
        [Extension("kvqueue._queue", ["src/kvqueue/_queue.pyx"], optional=True)],
        compiler_directives={"language_level": "3"},
    )
    # cythonize() rebuilds each Extension from a fixed list of settings and drops
    # ``optional``: without this, a missing compiler fails the install.
    for extension in extensions:
        extension.optional = True
    setup(ext_modules=extensions)
