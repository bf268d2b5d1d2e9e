"""Whether a libcuda exports the checkpoint API, read from its ELF dynamic symbols.

Loading libcuda to ask would initialise parts of the driver inside the checking process; reading
the ELF does not.
"""

from __future__ import annotations

import glob

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


def libcuda_checkpoint_symbols(path: str) -> dict[str, bool]:
    """{symbol: exported} for the checkpoint API symbols; raises OSError or ValueError."""
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
