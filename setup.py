"""Builds the optional C helpers; everything else is in pyproject.toml.

The helpers only make whole-node scans faster: where no compiler exists the install goes on
without them and snapguard uses its pure-Python scanner, which gives identical results.
"""

import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # no compiler, no headers: the pure-Python path remains
            print(f"snapguard: C helpers not built ({e}); using the pure-Python scanner", file=sys.stderr)

    def build_extension(self, ext) -> None:
        # A self-built Python (pyenv) puts an rpath to its own lib dir into LDSHARED. The helper
        # links no libpython (stable ABI), and on a node that path means nothing or, worse, names a
        # directory someone else may control, from which a root process would then load libraries.
        linker = getattr(self.compiler, "linker_so", None)
        if isinstance(linker, list):
            self.compiler.linker_so = [a for a in linker if not a.startswith(("-Wl,-rpath", "-Wl,-R"))]
        try:
            super().build_extension(ext)
        except Exception as e:
            print(f"snapguard: C helper {ext.name} not built ({e}); using the pure-Python scanner",
                  file=sys.stderr)


# cffi builds the helper for the stable ABI (it defines Py_LIMITED_API and marks the extension
# py_limited_api, so it is named _procscan.abi3.so); the wheel is tagged to match (cp311-abi3), so one
# wheel serves CPython 3.11 and every later 3.x.
setup(cffi_modules=["c_helpers/build_procscan.py:ffibuilder"], cmdclass={"build_ext": OptionalBuildExt},
      options={"bdist_wheel": {"py_limited_api": "cp311"}})
