"""Trusted paths: what snapguard runs, loads or writes as root must be controlled by root alone.

snapguard runs as root. Any file that decides what runs as root (the config file, runc, CRIU,
cuda-checkpoint, every shared object CRIU loads from its libdir, the files snapguard generates in
its state dir) is only as safe as the least protected directory on the way to it: whoever can
write one of those directories can rename the next component and swap in their own file, or plant
a symlink. So a path is trusted only when every directory traversed is owned by root and writable
by root alone, and the final object is too.

Two rules keep the check honest:

- The walk never follows a link blindly: each component is opened relative to the already checked
  parent's descriptor with O_PATH|O_NOFOLLOW and inspected with fstat; a symlink is read with
  readlink and its target walked the same way. Checking with stat and then opening by name would
  leave a window in which the name points somewhere else.
- Callers use what was checked: the canonical path returned (no symlinks, no ".."; safe because
  no one but root can change any of its components) or the descriptor returned.

A root-owned directory with the sticky bit (/tmp, 1777) may be passed through even though others
can write it: in a sticky directory only an entry's owner can rename or delete it, so an entry
owned by root cannot be swapped. Entries owned by anyone else are refused there.

When snapguard does not run as root (unit tests, a user's own checks), objects owned by the
effective uid are accepted as well as root's.

The walk itself is in `_walk`. This package sits near the executor's pass-through path (every runc
call containerd makes), so it imports only os, stat and errno at module level.
"""

from __future__ import annotations

import errno as _errno
import os
import stat

from ._walk import PROBE, UntrustedPathError, Walk, check_kind, join, os_failure, owners, writable_by

__all__ = [
    "UntrustedPathError",
    "check_trusted_libdir",
    "make_private_dir",
    "open_trusted",
    "private_tempdir",
    "resolve_trusted",
]


def resolve_trusted(path: str, kind: str) -> str:
    """The canonical path of `path` after checking that root alone controls it and every
    directory on the way, and that it is a `kind` ("file", "exec" or "dir").

    Run or load exactly the returned path: none of its components can be changed by anyone
    but root, while the path as given may go through symlinks.
    """
    check_kind(kind)
    try:
        with Walk(path) as walk:
            walk.run()
            walk.check_final(kind)
            return walk.canonical
    except OSError as e:
        raise os_failure(path, e) from None


def open_trusted(path: str, kind: str = "file", flags: int = os.O_RDONLY) -> int:
    """A descriptor of `path` opened with `flags` once it is checked as resolve_trusted does.

    The final component is opened relative to the descriptor of its checked parent, with
    O_NOFOLLOW (it cannot have become a symlink) and O_NONBLOCK (a FIFO cannot block the open),
    then checked again through the descriptor. Flags that create files are not meant for this.
    For a regular file O_NONBLOCK is cleared again before the descriptor is returned.
    """
    check_kind(kind)
    try:
        with Walk(path) as walk:
            walk.run()
            walk.check_final(kind)
            fd = walk.reopen(flags | (os.O_DIRECTORY if kind == "dir" else 0))
            try:
                st = os.fstat(fd)
                if not walk.same_object(st):
                    raise walk.fail(f"{walk.canonical} changed while it was opened")
                walk.check_final(kind, st)
                if stat.S_ISREG(st.st_mode):
                    os.set_blocking(fd, True)
            except BaseException:
                os.close(fd)
                raise
            return fd
    except OSError as e:
        raise os_failure(path, e) from None


def check_trusted_libdir(path: str) -> str:
    """The canonical path of CRIU's plugin directory once it and every plugin in it are trusted.

    CRIU dlopen()s every entry whose name ends in ".so" in its libdir, as root: each one's
    constructor runs as root, so each must be root's alone like a binary. A symlinked plugin is
    followed and its target checked.
    """
    try:
        with Walk(path) as walk:
            walk.run()
            walk.check_final("dir")
            dir_fd = walk.reopen(os.O_RDONLY | os.O_DIRECTORY)
            try:
                if not walk.same_object(os.fstat(dir_fd)):
                    raise walk.fail(f"{walk.canonical} changed while it was opened")
                for name in sorted(os.listdir(dir_fd)):
                    if name.endswith(".so"):
                        _check_plugin(walk.canonical, dir_fd, name)
            finally:
                os.close(dir_fd)
            return walk.canonical
    except OSError as e:
        raise os_failure(path, e) from None


def _check_plugin(libdir: str, dir_fd: int, name: str) -> None:
    here = join(libdir, name)
    try:
        fd = os.open(name, PROBE, dir_fd=dir_fd)
    except OSError as e:
        raise UntrustedPathError(here, e.strerror or "cannot be opened", e.errno) from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except OSError as e:
            raise UntrustedPathError(here, e.strerror or "cannot be read", e.errno) from None
        try:
            resolve_trusted(target if target.startswith("/") else join(libdir, target), "file")
        except UntrustedPathError as e:
            raise UntrustedPathError(here, f"links to {e}", e.errno) from None
        return
    if st.st_uid not in owners():
        raise UntrustedPathError(here, f"plugin {here} is owned by uid {st.st_uid}, not root")
    who = writable_by(st.st_mode)
    if who is not None:
        raise UntrustedPathError(here, f"plugin {here} is writable by {who}")
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedPathError(here, f"plugin {here} is not a regular file", _errno.EINVAL)


def make_private_dir(path: str, *, exist_ok: bool = True) -> str:
    """Create `path` and its missing parents 0700 (root's alone), or check and tighten an
    existing one; the canonical path is returned.

    For the state dir and image or work dirs, where snapguard writes files it or CRIU later run
    or trust: whoever could write such a directory could swap them. The existing part of the path
    must be trusted as in resolve_trusted; the final directory must not be a symlink, and when it
    exists it must already be root's alone (a directory others could write may hold what they
    planted) before it is tightened to 0700. Modes are set with fchmod, so the umask never
    matters. With exist_ok=False an existing final directory is refused.
    """
    try:
        with Walk(path) as walk:
            walk.run(follow_final=False, create=True)
            if not exist_ok and walk.canonical not in walk.created:
                raise walk.fail("already exists", _errno.EEXIST)
            walk.check_final("dir")
            fd = walk.reopen(os.O_RDONLY | os.O_DIRECTORY)
            try:
                st = os.fstat(fd)
                if not walk.same_object(st):
                    raise walk.fail(f"{walk.canonical} changed while it was opened")
                walk.check_final("dir", st)
                if stat.S_IMODE(st.st_mode) != 0o700:
                    os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
            return walk.canonical
    except OSError as e:
        raise os_failure(path, e) from None


def private_tempdir(parent: str, prefix: str) -> str:
    """A new directory of its own (0700) in the private directory `parent`, created if missing.

    Each snapshot run writes its generated files there, so two concurrent runs never race on
    the same names in the state dir.
    """
    import tempfile

    return tempfile.mkdtemp(prefix=prefix, dir=make_private_dir(parent))
