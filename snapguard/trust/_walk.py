"""The walk behind every trust check: each component opened relative to its checked parent's
descriptor (O_PATH|O_NOFOLLOW), inspected with fstat, a symlink's target walked the same way; the
ownership and mode rules a directory or final object must meet (snapguard.trust says why)."""

from __future__ import annotations

import errno as _errno
import os
import stat

__all__ = ["KINDS", "MAX_SYMLINKS", "PROBE", "UntrustedPathError", "Walk", "check_kind", "join", "os_failure",
           "owners", "writable_by"]

KINDS = ("file", "exec", "dir")
MAX_SYMLINKS = 40  # Linux's own limit (MAXSYMLINKS) on symlinks followed in one lookup

PROBE = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FD = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UntrustedPathError(Exception):
    """`path` must not be used as root; `why` says which component failed and how (one line).

    `errno` is set when the failure is about existence or type (ENOENT: a component does not
    exist; ENOTDIR, EISDIR, EACCES, ELOOP, EEXIST, ...) rather than about who controls the path:
    callers that accept a missing binary (preflight reports it later) tell the two apart with
    `missing` and `unusable`. `reason` is the snapguard.reasons.Reason member's name, a string so
    that this module need not import the enum.
    """

    reason = "UNTRUSTED_PATH"

    def __init__(self, path: str, why: str, errno: int | None = None) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path
        self.why = why
        self.errno = errno

    @property
    def missing(self) -> bool:
        """A component of the path does not exist (and everything before it is trusted)."""
        return self.errno == _errno.ENOENT

    @property
    def unusable(self) -> bool:
        """Missing or of the wrong type, as opposed to controlled by someone other than root."""
        return self.errno is not None


def owners() -> tuple[int, ...]:
    euid = os.geteuid()
    return (0,) if euid == 0 else (0, euid)


def writable_by(mode: int) -> str | None:
    group, others = bool(mode & stat.S_IWGRP), bool(mode & stat.S_IWOTH)
    if group and others:
        return "group and others"
    if group:
        return "group"
    if others:
        return "others"
    return None


def join(parent: str, name: str) -> str:
    return f"{parent.rstrip('/')}/{name}"


def _split(path: str) -> list[str]:
    """The components of `path` in reverse order (a stack to pop), "" and "." dropped."""
    return [c for c in reversed(path.split("/")) if c and c != "."]


class _Dir:
    """A directory of the walk: checked, held open (O_PATH) so that lookups below it are relative."""

    __slots__ = ("fd", "path", "sticky", "st")

    def __init__(self, fd: int, path: str, sticky: bool, st: os.stat_result) -> None:
        self.fd, self.path, self.sticky, self.st = fd, path, sticky, st


class Walk:
    """One walk of a path from "/": the checked directory stack and the final object.

    `parent` is the checked directory holding the final object (None when the final object is "/"
    itself), `name` its entry there, `fd` an O_PATH descriptor of it and `st` its fstat. The
    caller must close() the walk.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.stack: list[_Dir] = []
        self.parent: _Dir | None = None
        self.name = ""
        self.fd = -1
        self.st: os.stat_result | None = None
        self.canonical = "/"
        self.created: list[str] = []

    def close(self) -> None:
        for d in self.stack:
            os.close(d.fd)
        self.stack.clear()
        if self.parent is not None:
            os.close(self.parent.fd)
            self.parent = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Walk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fail(self, why: str, errno: int | None = None) -> UntrustedPathError:
        return UntrustedPathError(self.path, why, errno)

    def check_dir(self, path: str, st: os.stat_result) -> bool:
        """Refuse a directory others control; True when it is a root-owned sticky directory that
        others can write, so that each entry taken from it must be checked for its owner."""
        if st.st_uid not in owners():
            raise self.fail(f"directory {path} is owned by uid {st.st_uid}, not root")
        who = writable_by(st.st_mode)
        if who is None:
            return False
        if st.st_mode & stat.S_ISVTX and st.st_uid == 0:
            return True
        raise self.fail(f"directory {path} is writable by {who}")

    def check_entry_owner(self, parent: _Dir, path: str, st: os.stat_result) -> None:
        """In a sticky directory others can write, only the entry's owner can rename or delete it."""
        if parent.sticky and st.st_uid not in owners():
            raise self.fail(f"{path} is owned by uid {st.st_uid} in sticky directory {parent.path}")

    def run(self, *, follow_final: bool = True, create: bool = False) -> None:
        """Walk self.path. Missing components are created 0700 when `create` (the final one too);
        a final symlink is refused unless `follow_final`."""
        self._open_root()
        pending = _split(self.path)
        hops = 0
        final: tuple[int, str, os.stat_result] | None = None
        while pending:
            name = pending.pop()
            if name == "..":
                if len(self.stack) > 1:
                    os.close(self.stack.pop().fd)
                continue
            parent = self.stack[-1]
            here = join(parent.path, name)
            last = not pending
            fd, st = self._open_entry(parent, name, here, create)
            try:
                self.check_entry_owner(parent, here, st)
                if stat.S_ISLNK(st.st_mode):
                    if last and not follow_final:
                        raise self.fail(f"{here} is a symbolic link", _errno.ELOOP)
                    hops += 1
                    if hops > MAX_SYMLINKS:
                        raise self.fail("too many levels of symbolic links", _errno.ELOOP)
                    target = os.readlink(name, dir_fd=parent.fd)
                    if target.startswith("/"):
                        while len(self.stack) > 1:
                            os.close(self.stack.pop().fd)
                    pending.extend(_split(target))
                    os.close(fd)
                    continue
                if last:
                    final = (fd, name, st)
                    break
                if not stat.S_ISDIR(st.st_mode):
                    raise self.fail(f"{here} is not a directory", _errno.ENOTDIR)
                sticky = self.check_dir(here, st)
            except BaseException:
                os.close(fd)
                raise
            self.stack.append(_Dir(fd, here, sticky, st))
        self._end(final)

    def _open_root(self) -> None:
        """Check the path's form and put "/", checked, at the bottom of the stack."""
        if not self.path.startswith("/"):
            raise self.fail("not an absolute path", _errno.EINVAL)
        if "\0" in self.path:
            raise self.fail("contains a NUL byte", _errno.EINVAL)
        fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        st = os.fstat(fd)
        try:
            sticky = self.check_dir("/", st)
        except BaseException:
            os.close(fd)
            raise
        self.stack.append(_Dir(fd, "/", sticky, st))

    def _end(self, final: tuple[int, str, os.stat_result] | None) -> None:
        """Take the final object (opened, not yet on the stack) and its parent."""
        if final is None:
            # The path ends in a directory already on the stack ("/", "/a/..", a link to ".").
            top = self.stack.pop()
            self.fd, self.st, self.canonical = top.fd, top.st, top.path
            self.name = top.path.rsplit("/", 1)[1] or "/"
            if self.stack:
                self.parent = self.stack.pop()
        else:
            self.fd, self.name, self.st = final
            self.parent = self.stack.pop()
            self.canonical = join(self.parent.path, self.name)

    def _open_entry(self, parent: _Dir, name: str, here: str, create: bool) -> tuple[int, os.stat_result]:
        try:
            fd = os.open(name, PROBE, dir_fd=parent.fd)
        except FileNotFoundError:
            if not create:
                raise self.fail("does not exist", _errno.ENOENT) from None
            self._mkdir(parent, name, here)
            try:
                fd = os.open(name, PROBE, dir_fd=parent.fd)
            except OSError as e:
                raise self.fail(f"{here}: {e.strerror}", e.errno) from None
        except OSError as e:
            raise self.fail(f"{here}: {e.strerror}", e.errno) from None
        try:
            return fd, os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise

    def _mkdir(self, parent: _Dir, name: str, here: str) -> None:
        """Create a missing directory 0700 whatever the umask (mkdir's mode is masked by it; the
        fchmod is not). Another snapguard creating it at the same time is fine: the entry is then
        checked like any existing one."""
        try:
            os.mkdir(name, 0o700, dir_fd=parent.fd)
        except FileExistsError:
            return
        except OSError as e:
            raise self.fail(f"cannot create {here}: {e.strerror}", e.errno) from None
        try:
            fd = os.open(name, _DIR_FD, dir_fd=parent.fd)
        except OSError as e:
            raise self.fail(f"{here}: {e.strerror}", e.errno) from None
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
        self.created.append(here)

    def check_final(self, kind: str, st: os.stat_result | None = None) -> None:
        """The final object: root's alone, and of the kind the caller will use it as."""
        st = self.st if st is None else st
        assert st is not None
        what = "directory" if stat.S_ISDIR(st.st_mode) else "file"
        if st.st_uid not in owners():
            raise self.fail(f"{what} {self.canonical} is owned by uid {st.st_uid}, not root")
        who = writable_by(st.st_mode)
        if who is not None:
            raise self.fail(f"{what} {self.canonical} is writable by {who}")
        if kind == "dir":
            if not stat.S_ISDIR(st.st_mode):
                raise self.fail(f"{self.canonical} is not a directory", _errno.ENOTDIR)
        elif not stat.S_ISREG(st.st_mode):
            raise self.fail(f"{self.canonical} is not a regular file",
                            _errno.EISDIR if stat.S_ISDIR(st.st_mode) else _errno.EINVAL)
        elif kind == "exec" and not st.st_mode & 0o111:
            raise self.fail(f"{self.canonical} is not an executable file", _errno.EACCES)

    def reopen(self, flags: int) -> int:
        """The final object opened for use, relative to its checked parent: no window between the
        check and the open. O_NONBLOCK so that a FIFO put in a file's place cannot hang us."""
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            if self.parent is None:
                return os.open("/", flags)
            return os.open(self.name, flags, dir_fd=self.parent.fd)
        except OSError as e:
            raise self.fail(f"{self.canonical}: {e.strerror}", e.errno) from None

    def same_object(self, st: os.stat_result) -> bool:
        assert self.st is not None
        return (st.st_dev, st.st_ino) == (self.st.st_dev, self.st.st_ino)


def os_failure(path: str, e: OSError) -> UntrustedPathError:
    """An unexpected system call failure during a walk, as the one error type callers handle."""
    return UntrustedPathError(path, e.strerror or str(e), e.errno)


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
