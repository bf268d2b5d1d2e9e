"""The trainer's side of the spill: the arena as a file of its own on a tmpfs (`SpillArena`), whose
descriptor the take's answer hands to the executor, none of it mapped or open here while the
snapshot is taken; the release passes a file back to reload from."""

from __future__ import annotations

import os
from typing import Any

from ..protocol import TMPFS_MAGIC, fs_type, take_spill_source_name
from .libc import bound_libc
from .ring import Arena

__all__ = ["MADV_POPULATE_WRITE", "SpillArena"]

MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable, an error instead of SIGBUS


class SpillArena(Arena):
    """The arena as a file of its own on a tmpfs (`env.spill_dir`), when the executor asks for it (a
    process in its executor's mount namespace, outside a container).

    Why: CRIU writes every page of the frozen process through one thread, after the driver's
    checkpoint, inside the stall: 20.9 GB in 7.9-15.7 s for the 1.2 B trainer on the H200, 19.2 GB
    of it the moved bytes. This file is handed to the executor over the take socket (its
    descriptor), then unmapped and closed here before the hold is reported: CRIU never sees it, and
    the executor writes it into the image beside CRIU's run, or, for a leave-running snapshot, after
    the release. Its name stays until the reload, so a hold that ends without the executor (it gave
    up, or is gone) still finds its bytes. The pages are faulted in by MADV_POPULATE_WRITE just
    before the copies into them: a tmpfs that is full then fails the take with an error ("failed",
    nothing moved) instead of a SIGBUS in the trainer."""

    def __init__(self, torch: Any, size: int, directory: str) -> None:
        import mmap

        self.size = size
        self.map: Any = None
        self.fd: int | None = None
        self.identity: tuple[int, int] | None = None
        self.path = os.path.join(directory, take_spill_source_name(os.getpid()))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            st = os.fstat(fd)
            self.identity = (st.st_dev, st.st_ino)
            if fs_type(fd) != TMPFS_MAGIC:  # the executor takes only a file in memory (nor would a disk's be quick)
                raise OSError(f"{directory} is not a tmpfs")
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            # Huge pages where the tmpfs was mounted to give them: huge=within_size (as a node
            # mounts protocol.SPILL_TMPFS) gives them whatever is asked, huge=advise only where
            # asked, as here; a tmpfs mounted without huge= (/dev/shm as distributions mount
            # it) gives 4 KiB pages unless the node's shmem_enabled is "force"
            advice = getattr(mmap, "MADV_HUGEPAGE", None)
            if advice is not None:
                try:
                    self.map.madvise(advice)
                except OSError:  # transparent huge pages are off in this kernel
                    pass
            self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
            self.populate(self.bytes, 1)  # a kernel without MADV_POPULATE_WRITE: no spill (OSError)
        except BaseException:
            os.close(fd)
            self.discard()
            raise
        self.fd = fd

    def populate(self, host: Any, n: int | None = None) -> None:
        """Fault in the pages under `host` (a uint8 view of this arena, page-aligned) writable."""
        length = host.numel() if n is None else n
        if bound_libc().madvise(host.data_ptr(), length, MADV_POPULATE_WRITE) != 0:
            import ctypes

            err = ctypes.get_errno()
            raise OSError(err, f"spill file {self.path}: {os.strerror(err)}")

    def _unmap(self) -> None:
        if self.map is not None:
            Arena.close(self)
            self.map = None

    def handover(self, end: int) -> int | None:
        """Unmapped and cut to `end` (a partial take's last moved byte: the executor copies no
        hole); the descriptor, for the executor (the caller closes it once it is sent)."""
        self._unmap()
        fd, self.fd = self.fd, None
        if fd is not None and end < self.size:
            try:
                os.ftruncate(fd, end)
                self.size = end
            except OSError:
                pass  # handed over whole: the hole is copied too
        return fd

    def reopen(self) -> int:
        """A descriptor of this file through its name, when it is still the file made here."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.identity:
            os.close(fd)
            raise OSError(f"spill file {self.path} is another file now")
        return fd

    def discard(self) -> None:
        """Its name gone (when it is still this file's) and the mapping unmapped; never raises."""
        self._unmap()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            st = os.lstat(self.path)
            if self.identity is None or (st.st_dev, st.st_ino) == self.identity:
                os.unlink(self.path)  # None: failed before its identity was read, made by us all the same
        except OSError:
            pass  # gone already (another node's restore has no such name)

    def close(self) -> None:
        self.discard()


