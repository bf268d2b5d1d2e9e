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
        try:
            super().build_extension(ext)
        except Exception as e:
            print(f"snapguard: C helper {ext.name} not built ({e}); using the pure-Python scanner",
                  file=sys.stderr)


setup(cffi_modules=["c_helpers/build_procscan.py:ffibuilder"], cmdclass={"build_ext": OptionalBuildExt})
