"""Builds the optional C helpers and packs the launcher's sources; everything else is in pyproject.toml.

The helpers only make whole-node scans faster: where no compiler exists the install goes on
without them and snapguard uses its pure-Python scanner, which gives identical results.

snapguard-runc's C launcher is compiled on the node by `snapguard install` (snapguard/install/),
not here: a built package (the wheel, hence the Debian package) carries its two sources as package
data in snapguard/_c_helpers/, copied from c_helpers/ at build time (the source tree has no
snapguard/_c_helpers; an editable install finds c_helpers/ beside the package).
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
# the launcher's sources (snapguard.install.LAUNCHER_SOURCES), from c_helpers/ to snapguard/_c_helpers/
LAUNCHER_SOURCES = ("runc_launcher.c", "runc_argv_table.h")


class BuildPyWithLauncher(build_py):
    """build_py, plus the launcher's sources at snapguard/_c_helpers/ in the build (not editable)."""

    def _launcher_outputs(self) -> list[tuple[str, str]]:
        if getattr(self, "editable_mode", False):
            return []  # the editable install reads c_helpers/ in the source tree
        target = os.path.join(self.build_lib, "snapguard", "_c_helpers")
        return [(os.path.join(HERE, "c_helpers", name), os.path.join(target, name)) for name in LAUNCHER_SOURCES]

    def run(self) -> None:
        super().run()
        for source, target in self._launcher_outputs():
            if not os.path.isfile(source):  # a built package without them would fall back silently
                raise SystemExit(f"snapguard: the launcher's source {source} is missing")
            self.mkpath(os.path.dirname(target))
            self.copy_file(source, target, preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), *(t for _, t in self._launcher_outputs())]


class SdistWithCHelpers(sdist):
    """The sdist carries c_helpers/ (the procscan build script and sources, the launcher's sources),
    so a wheel built from it is the wheel built from the repository."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        helpers = sorted(f"c_helpers/{name}" for name in os.listdir(os.path.join(HERE, "c_helpers"))
                         if name.endswith((".py", ".c", ".h")))
        super().make_release_tree(base_dir, [*files, *(f for f in helpers if f not in files)])


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
# py_limited_api, so it is named _procscan.abi3.so); the wheel is tagged to match (cp310-abi3), so one
# wheel serves CPython 3.10 and every later 3.x.
setup(cffi_modules=["c_helpers/build_procscan.py:ffibuilder"],
      cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPyWithLauncher, "sdist": SdistWithCHelpers},
      options={"bdist_wheel": {"py_limited_api": "cp310"}})
