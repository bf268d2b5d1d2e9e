"""Ask the kernel to read files into the page cache ahead of the program that needs them.

Why: on a restore from a cold page cache (a node that has not run CRIU since it booted, an image
just fetched to disk), the restore's digest check reads the whole image with 16 threads from its
first moment, and CRIU's start (the loader mapping its libraries a page fault at a time, then its
small image files) queues behind those reads: on the H200, 0.7-2.2 s from the call to CRIU's first
log line against 0.2 s warm. Asked for first (POSIX_FADV_WILLNEED: the reads are issued at once)
and read through (`wait`: a disk busy with larger reads may serve the issued ones late), the few
MB CRIU starts with are in memory before the large reads begin: 0.14-0.19 s, as warm.

Only reads: nothing here decides what runs. The binaries' paths are the config's (root's, checked
by snapguard.trust where they are used); the libraries are those their ELF headers name, found the
way the loader would (DT_RPATH, DT_RUNPATH, then the system's directories); image files are opened
relative to the image directory without following links. Never raises: a file that cannot be read
here is read by its program as before.
"""

from __future__ import annotations

import os
import platform
import stat
import struct

__all__ = ["closure", "criu_plugins", "read_ahead", "willneed_at"]

_MAX_FILES = 128  # a binary and its libraries: CRIU needs about 25
_DYNAMIC_MAX = 1 << 20  # the dynamic section and its strings: a few KB in any real file
_PT_LOAD, _PT_DYNAMIC, _PT_INTERP = 1, 2, 3
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_STRSZ, _DT_RPATH, _DT_RUNPATH = 0, 1, 5, 10, 15, 29


def _system_dirs() -> tuple[str, ...]:
    triplet = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(platform.machine(), "")
    multiarch = (f"/lib/{triplet}", f"/usr/lib/{triplet}") if triplet else ()
    return (*multiarch, "/lib64", "/usr/lib64", "/lib", "/usr/lib")


def _open_regular(path: str, dir_fd: int | None = None, follow: bool = True) -> int | None:
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _dynamic(fd: int) -> tuple[str | None, list[str], list[str]] | None:
    """(interpreter, needed, search dirs from DT_RPATH then DT_RUNPATH) of a 64-bit little-endian
    ELF file, or None for anything else (a script, another format, a truncated file)."""
    head = os.pread(fd, 64, 0)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return None
    phoff, = struct.unpack_from("<Q", head, 32)
    phentsize, phnum = struct.unpack_from("<HH", head, 54)
    if phentsize < 56 or phnum > 256:
        return None
    table = os.pread(fd, phentsize * phnum, phoff)
    loads, dynamic, interp = [], None, None
    for i in range(phnum):
        at = i * phentsize
        if at + 56 > len(table):
            return None
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", table, at)
        if p_type == _PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
        elif p_type == _PT_INTERP and p_filesz <= 4096:
            interp = os.pread(fd, p_filesz, p_offset).split(b"\0", 1)[0].decode(errors="replace") or None
    if dynamic is None or dynamic[1] > _DYNAMIC_MAX:
        return interp, [], []
    section = os.pread(fd, dynamic[1], dynamic[0])
    entries: list[tuple[int, int]] = []
    for at in range(0, len(section) - 15, 16):
        tag, val = struct.unpack_from("<qQ", section, at)
        if tag == _DT_NULL:
            break
        entries.append((tag, val))
    tags = dict(entries)
    strtab, strsz = tags.get(_DT_STRTAB), min(tags.get(_DT_STRSZ, 0), _DYNAMIC_MAX)
    base = next((offset + strtab - vaddr for vaddr, offset, filesz in loads
                 if strtab is not None and vaddr <= strtab < vaddr + filesz), None)
    if base is None or not strsz:
        return interp, [], []
    strings = os.pread(fd, strsz, base)

    def string(index: int) -> str | None:
        end = strings.find(b"\0", index)
        return strings[index:end].decode(errors="replace") if 0 <= index < len(strings) and end >= 0 else None

    needed = [s for tag, val in entries if tag == _DT_NEEDED and (s := string(val))]
    dirs = [d for tag in (_DT_RPATH, _DT_RUNPATH) for t, val in entries if t == tag
            for d in (string(val) or "").split(":") if d]
    return interp, needed, dirs


def closure(binary: str) -> list[str]:
    """`binary`, its loader and the shared libraries it needs, transitively, as paths that exist,
    looked for about as the loader does (each file's own DT_RPATH / DT_RUNPATH, the first ELF
    file's for all, then the system's directories; no ld.so.cache); a script's `#!` interpreter's
    closure after it."""
    return _walk(binary, False, [])


def read_ahead(binaries: list[str], wait: bool = False) -> tuple[int, int]:
    """Readahead asked for each of `binaries` and its closure, each file once, as it is found (a
    cold file's headers are read while the rest of it is on the way); (files, bytes) asked for.
    `wait`: then read through, so that each is in memory on return (the reads issued are not
    otherwise awaited, and a disk busy with larger reads serves them late)."""
    seen: dict[str, None] = {}
    sizes: list[int] = []
    for binary in binaries:
        for path in _walk(binary, True, sizes, set(seen)):
            seen[path] = None
    if wait:
        for path in seen:
            fd = _open_regular(path)
            if fd is not None:
                try:
                    _read_through(fd)
                finally:
                    os.close(fd)
    return len(seen), sum(sizes)


def criu_plugins(libdir: str) -> list[str]:
    """The plugins CRIU loads from `libdir`, sorted: every entry whose name ends in ".so", a link
    among them (CRIU dlopen()s each such name, following links; snapguard.trust checks the same
    set); [] where the directory cannot be listed."""
    try:
        names = os.listdir(libdir)
    except OSError:
        return []
    return sorted(os.path.join(libdir, name) for name in names if name.endswith(".so"))


def _read_through(fd: int) -> None:
    buf = bytearray(1 << 20)
    offset = 0
    try:
        while (n := os.preadv(fd, [buf], offset)) > 0:
            offset += n
    except OSError:
        pass


def _walk(binary: str, advise: bool, sizes: list[int], seen: set[str] | None = None) -> list[str]:
    """closure(); with `advise`, each file asked for as it is found, its size appended to `sizes`;
    files in `seen` (another binary's closure) neither asked for again nor walked."""
    found: list[str] = []
    inherited: list[str] | None = None
    todo = [binary]
    while todo and len(found) < _MAX_FILES:
        path = todo.pop(0)
        if path in found or (seen is not None and path in seen):
            continue
        fd = _open_regular(path)
        if fd is None:
            continue
        found.append(path)
        try:
            if advise:  # the whole file asked for first: its headers, read next, are then on the way
                sizes.append(_advise(fd))
            first = os.pread(fd, 256, 0)
            parsed = None if first.startswith(b"#!") else _dynamic(fd)
        except (OSError, struct.error, OverflowError, ValueError):  # offsets a damaged file makes up
            continue
        finally:
            os.close(fd)
        if first.startswith(b"#!"):
            words = first[2:].split(b"\n", 1)[0].split()
            if path == binary and words and words[0].startswith(b"/"):
                todo.append(words[0].decode(errors="replace"))
            continue
        if parsed is None:
            continue
        interp, needed, dirs = parsed
        origin = os.path.dirname(path)
        own = [d.replace("$ORIGIN", origin).replace("${ORIGIN}", origin) for d in dirs]
        if inherited is None:
            inherited = own  # the executable's: the loader searches them for every library it loads
        search = list(dict.fromkeys(own + inherited + list(_system_dirs())))
        if interp:
            todo.append(interp)
        for name in needed:
            if "/" in name:
                todo.append(name)
                continue
            hit = next((os.path.join(d, name) for d in search if os.path.exists(os.path.join(d, name))), None)
            if hit is not None:
                todo.append(hit)
    return found


def willneed_at(dir_fd: int, names: list[str], wait: bool = False) -> tuple[int, int]:
    """Readahead asked for the regular files `names` of a directory (an image's): opened relative
    to `dir_fd`, no link followed; (files, bytes) asked for. `wait`: as read_ahead's."""
    fds: list[int] = []
    size = 0
    try:
        for name in names:
            if "/" in name or name in ("", ".", ".."):
                continue
            fd = _open_regular(name, dir_fd=dir_fd, follow=False)
            if fd is not None:
                fds.append(fd)
                size += _advise(fd)
        if wait:
            for fd in fds:
                _read_through(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return len(fds), size


def _advise(fd: int) -> int:
    try:
        length = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return length
    except OSError:
        return 0
