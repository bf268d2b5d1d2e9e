"""cffi build script for snapguard._procscan (API mode, compiled at install time)."""

import os
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent

ffibuilder = FFI()
ffibuilder.cdef((HERE / "procscan.h").read_text().split("*/", 1)[1])
ffibuilder.set_source(
    "snapguard._procscan",
    '#include "procscan.h"',
    # setuptools refuses absolute paths; the build runs from the repository root
    sources=[os.path.relpath(HERE / "procscan.c")],
    include_dirs=[os.path.relpath(HERE)],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-pthread"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
