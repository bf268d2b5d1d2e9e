"""Whether a libcuda exports the checkpoint API, read from its ELF dynamic symbols.

Loading libcuda to ask would initialise parts of the driver inside the checking process; reading
the ELF does not.
"""

from __future__ import annotations

import glob
import os

from ._driver import CHECKPOINT_SYMBOLS

__all__ = ["find_libcuda", "libcuda_checkpoint_symbols"]

LIBCUDA_GLOBS = ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1", "/usr/lib/libcuda.so.1",
                 "/usr/local/nvidia/lib64/libcuda.so.1", "/usr/local/nvidia/lib/libcuda.so.1",
                 "/usr/lib/wsl/lib/libcuda.so.1")


def find_libcuda() -> str | None:
    for pattern in LIBCUDA_GLOBS:
        for path in sorted(glob.glob(pattern)):
            return path
    return None


# what each file said, by its identity (device, inode, size, mtime): a long-lived process (the
# agent, whose host checks run ahead of a notice) parses a libcuda of tens of MB once, not per check
_READ: dict[tuple[str, int, int, int, int], dict[str, bool]] = {}


def libcuda_checkpoint_symbols(path: str) -> dict[str, bool]:
    """{symbol: exported} for the checkpoint API symbols; raises OSError or ValueError. The file
    is read once per identity (device, inode, size, mtime) in a process: a driver upgrade replaces
    it and is read anew."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    known = _READ.get(key)
    if known is None:
        known = _READ[key] = _read_symbols(path)
    return dict(known)


def _read_symbols(path: str) -> dict[str, bool]:
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            dynsym = elf.get_section_by_name(".dynsym")
            if not isinstance(dynsym, SymbolTableSection):
                raise ValueError(f"{path} has no dynamic symbol table")
            exported = {s.name for s in dynsym.iter_symbols()
                        if s["st_shndx"] != "SHN_UNDEF" and s["st_info"]["type"] == "STT_FUNC"}
    except ELFError as e:
        raise ValueError(f"{path} is not a readable ELF file: {e}") from None
    return {name: name in exported for name in CHECKPOINT_SYMBOLS}
