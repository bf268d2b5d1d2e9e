"""Reading an image directory without following links: the opens, type and owner checks and
capped reads that sealing, verifying and hashing share.

The directory is opened once with O_NOFOLLOW and every file relative to that descriptor
(O_NOFOLLOW, O_NONBLOCK), checked with fstat to be a regular file, and then read through that
descriptor. A directory or file to trust must be root's alone.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from .. import trust
from ..names import NOT_IMAGE_FILES
from ..reasons import Reason, SnapguardError

MAX_FILES = 100_000  # also the schema's maxProperties of `files`
MAX_MARKER_BYTES = 4096
MAX_MANIFEST_BYTES = 64 << 20
MAX_DETAIL = 300
READ = 4 << 20
O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO in a file's place must not block the open (nor the reads: they are refused
# by fstat before any read).
O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def not_image(name: str) -> bool:
    """Snapguard's own files and what a restore writes in place (snapguard.names), and temporary names."""
    return name in NOT_IMAGE_FILES or ".tmp." in name


def show(name: str, limit: int = 120) -> str:
    """A name from a directory or a manifest, fit for a one-line message."""
    text = name if name.isprintable() else ascii(name)
    return text if len(text) <= limit else text[:limit] + "..."


def kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def untrusted(st: os.stat_result) -> str | None:
    """Why an image directory or file owned or writable by someone else is not root's alone."""
    if st.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {st.st_uid}, not root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


class NotRegular(Exception):
    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class Changed(Exception):
    """An image file was replaced between its check and its hashing."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def open_regular(dir_fd: int, name: str) -> tuple[int, os.stat_result]:
    """`name` (one component) in the directory `dir_fd`, opened for reading; NotRegular unless it
    is a regular file. Its type is checked before the open (opening a device can act on it) and
    again on the descriptor, which must be the object checked."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(kind(st.st_mode))
    fd = os.open(name, O_FILE, dir_fd=dir_fd)
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise NotRegular("replaced while it was opened")
    except BaseException:
        os.close(fd)
        raise
    return fd, fst


def read_capped(fd: int, cap: int) -> bytes:
    """At most cap + 1 bytes: a longer read tells the caller the file is over its cap."""
    chunks, left = [], cap + 1
    while left > 0:
        block = os.read(fd, min(READ, left))
        if not block:
            break
        chunks.append(block)
        left -= len(block)
    return b"".join(chunks)


def no_constant(name: str) -> Any:
    """json's parse_constant: NaN and Infinity are not JSON numbers."""
    raise ValueError(f"{name} is not a JSON number")


def _trusted_path(image_dir: str) -> str:
    """The image directory's canonical path once every directory above it is root's alone."""
    evidence = {"image": image_dir}
    parent, base = os.path.split(os.path.abspath(image_dir))
    if not base:
        raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"{image_dir} is not an image directory", evidence=evidence)
    try:
        # The walk of the image directory itself: a sticky parent (/tmp) is fine when the image
        # directory in it is root's (nobody else can rename it), which the walk checks
        if os.path.islink(os.path.join(parent, base)):
            raise trust.UntrustedPathError(os.path.join(parent, base), "is a symlink: snapguard never follows "
                                           "one into an image")
        parent, base = os.path.split(trust.resolve_trusted(os.path.join(parent, base), "dir"))
    except trust.UntrustedPathError as e:
        if e.missing:
            raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"image directory {image_dir} does not exist",
                                 evidence=evidence) from None
        if e.unusable:  # not a directory, name too long, a link loop: no image directory at all
            raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"image directory {image_dir}: {e.why}",
                                 evidence={"image": image_dir, "path": e.path}) from None
        raise SnapguardError(Reason.UNTRUSTED_PATH, str(e), evidence={"image": image_dir, "path": e.path}) from None
    return os.path.join(parent, base)


def open_image_dir(image_dir: str) -> tuple[int, str]:
    """The image directory opened (O_NOFOLLOW) once it and every directory above it are root's
    alone; with its canonical path."""
    path = _trusted_path(image_dir)
    evidence = {"image": image_dir, "path": path}
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"image directory {image_dir} does not exist",
                             evidence=evidence) from None
    except OSError as e:
        raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"image directory {image_dir}: {e.strerror}",
                             evidence=evidence) from None
    if stat.S_ISLNK(st.st_mode):
        raise SnapguardError(Reason.UNTRUSTED_PATH, f"image directory {path} is a symlink: snapguard never "
                             "follows one into an image", evidence=evidence)
    if not stat.S_ISDIR(st.st_mode):
        raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"image directory {image_dir} is not a directory",
                             evidence=evidence)
    try:
        dir_fd = os.open(path, O_DIR)
    except OSError as e:
        raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"image directory {path} cannot be opened: {e.strerror}",
                             evidence=evidence) from None
    try:
        why = untrusted(os.fstat(dir_fd))
        if why:
            raise SnapguardError(Reason.UNTRUSTED_PATH, f"image directory {path} {why}: others could have "
                                 "planted or changed what CRIU would restore as root", evidence=evidence)
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd, path


def read_member(dir_fd: int, name: str, cap: int, image_dir: str, reason: Reason) -> bytes:
    """The whole of snapguard's own file `name` in the image (marker or manifest), at most `cap`
    bytes; anything but a regular file of root's is refused with `reason`. FileNotFoundError
    propagates."""
    evidence = {"image": image_dir, "path": os.path.join(image_dir, name)}
    try:
        fd, st = open_regular(dir_fd, name)
    except NotRegular as e:
        raise SnapguardError(reason, f"{name} in {image_dir} is {e.kind}, not a regular file",
                             evidence=evidence) from None
    except FileNotFoundError:
        raise
    except OSError as e:
        raise SnapguardError(reason, f"cannot open {name} in {image_dir}: {e.strerror}", evidence=evidence) from None
    try:
        why = untrusted(st)
        if why:
            raise SnapguardError(Reason.UNTRUSTED_PATH, f"{name} in {image_dir} {why}", evidence=evidence)
        if st.st_size > cap:
            raise SnapguardError(reason, f"{name} in {image_dir} is {st.st_size} bytes, more than {cap}",
                                 evidence=evidence)
        try:
            data = read_capped(fd, cap)
        except OSError as e:
            raise SnapguardError(reason, f"cannot read {name} in {image_dir}: {e.strerror}",
                                 evidence=evidence) from None
    finally:
        os.close(fd)
    if len(data) > cap:
        raise SnapguardError(reason, f"{name} in {image_dir} is more than {cap} bytes", evidence=evidence)
    return data
