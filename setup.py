"""Build the compiled twin, unless a pure build is asked for or cannot be had.

``KVQUEUE_PURE=1`` (or a non-CPython interpreter) builds a pure wheel. With no
working compiler the build still succeeds: it warns on stderr, the wheel holds
the pure twin only and is tagged ``py3-none-any`` (not this interpreter's
platform, which it does not need), and ``import kvqueue`` uses the pure twin.
"""

import contextlib
import importlib.util
import os
import platform
import sys
import textwrap

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext
from setuptools.errors import BaseError, CCompilerError


def _pure_build() -> bool:
    # kvqueue's own parser, loaded by path: the package is not importable yet.
    spec = importlib.util.spec_from_file_location("_kvqueue_env", "src/kvqueue/_env.py")
    assert spec is not None and spec.loader is not None
    env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(env)
    return env.flag(env.PURE) or platform.python_implementation() != "CPython"


class build_ext_or_pure(build_ext):
    """build_ext that drops an extension it cannot build, and says so on stderr.

    Dropped from the distribution's ``ext_modules`` (after the build loop, which
    iterates that list): bdist_wheel then sees a pure distribution, and an in-place
    build copies nothing. Its module built by an earlier run is deleted: pip builds a
    checkout in its ``build/``, from which the pure wheel would take that module, compiled
    from older sources. Catches what a missing or broken compiler raises (compile, link,
    exec and platform errors); anything else fails the build.
    """

    def build_extensions(self) -> None:
        self._failed: list[Extension] = []
        super().build_extensions()
        for ext in self._failed:
            self.extensions.remove(ext)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except (CCompilerError, BaseError) as exc:
            self._failed.append(ext)
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.get_ext_fullpath(ext.name))
            # pip shows a build's output only with -v (or when it fails): the warning is for
            # that log, each line within 100 columns as pip indents it (by two); import kvqueue
            # warns again at run time.
            said = (
                f"the compiled queue ({ext.name}) could not be built, so this install has the "
                "pure-Python twin only (kvqueue.IMPLEMENTATION == 'python': the same queue, "
                "slower calls); for the compiled one, install a C compiler and the Python "
                f"headers, then reinstall. The build's error: {type(exc).__name__}: {exc}"
            )
            lines = textwrap.wrap(said, 98 - len("WARNING: kvqueue: "), break_on_hyphens=False)
            print("", *(f"WARNING: kvqueue: {line}" for line in lines), sep="\n", file=sys.stderr)
            sys.stderr.flush()


class bdist_wheel_or_pure(bdist_wheel):
    """bdist_wheel that tags the wheel by what was built, not by what was asked for.

    bdist_wheel decides purity in finalize_options, before build_ext has run: build
    first, then decide. Builds once (run_command skips a command that has run).
    """

    def run(self) -> None:
        if not self.skip_build:
            self.run_command("build")
        self.root_is_pure = not self.distribution.has_ext_modules()
        super().run()


if _pure_build():
    setup()
else:
    from Cython.Build import cythonize

    setup(
        ext_modules=cythonize(
            [
                Extension(
                    "kvqueue._queue",
                    ["src/kvqueue/_queue.pyx"],
                    depends=["src/kvqueue/_slots.h", "src/kvqueue/_member.h"],
                ),
                Extension(
                    "kvqueue.vllm._screen",
                    ["src/kvqueue/vllm/_screen.pyx"],
                    depends=["src/kvqueue/vllm/_screen.h", "src/kvqueue/_member.h"],
                ),
            ],
            compiler_directives={"language_level": "3"},
        ),
        cmdclass={"build_ext": build_ext_or_pure, "bdist_wheel": bdist_wheel_or_pure},
    )
