"""Build of nnpd's one C extension, `_probes`; everything else is in pyproject.toml.

Without a working C compiler the set-up still succeeds: probes.py then uses its
pure-Python fallback, and one line says so.
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

FALLBACK_NOTICE = (
    "nnpd: C extension _probes not built (no working C compiler: {why}); probes use the pure-Python fallback"
)
BUILD_ERRORS = (CCompilerError, ExecError, PlatformError, OSError)


class OptionalBuildExt(build_ext):
    """build_ext that turns a failed compile into one line instead of a failed set-up."""

    def run(self):
        """Build, or say in one line why not (e.g. no compiler for this platform)."""
        try:
            super().run()
        except BUILD_ERRORS as error:
            print(FALLBACK_NOTICE.format(why=one_line(error)), file=sys.stderr)

    def build_extension(self, ext):
        """Compile one extension, or say in one line why it could not be."""
        try:
            super().build_extension(ext)
        except BUILD_ERRORS as error:
            print(FALLBACK_NOTICE.format(why=one_line(error)), file=sys.stderr)


def one_line(error):
    """The kind of error and the start of its message's first line, for the one-line notice."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= 80 else text[:77] + "..."


setup(
    # optional: an editable install then skips copying a .so that was never built
    ext_modules=[Extension("_probes", ["_probes.c"], optional=True)],
    cmdclass={"build_ext": OptionalBuildExt},
)
