"""A CRI checkpoint archive of the shape containerd's CheckpointContainer writes (config.dump,
spec.dump, rootfs-diff.tar, checkpoint/ with CRIU's images and snapguard's seal), made without a
runtime: for the tests of what is done with an archive once it exists (made an image, pushed)."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

__all__ = ["ROOTFS_DIFF", "SPILL", "write_archive"]

ROOTFS_DIFF = 10240  # rootfs-diff.tar's bytes
SPILL = 4096  # the take point's spilled bytes (checkpoint/snapguard-take-7.bin)


def _member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def write_archive(path: Path, pages: int) -> Path:
    """The archive at `path`: `pages` random bytes of memory pages, 8 files in all."""
    with tarfile.open(path, "w") as tf:
        _member(tf, "config.dump", json.dumps({"name": "trainer", "rootfsImageName": "reg/x:1",
                                               "checkpointedTime": "2026-12-03T20:00:00Z"}).encode())
        _member(tf, "spec.dump", json.dumps({"annotations": {"io.kubernetes.cri.container-name": "trainer",
                                                             "io.kubernetes.cri.sandbox-name": "pod-0"}}).encode())
        _member(tf, "rootfs-diff.tar", b"d" * ROOTFS_DIFF)
        info = tarfile.TarInfo("checkpoint")
        info.type = tarfile.DIRTYPE
        tf.addfile(info)
        _member(tf, "checkpoint/pages-1.img", os.urandom(pages))
        _member(tf, "checkpoint/snapguard-take-7.bin", b"s" * SPILL)
        _member(tf, "checkpoint/core-7.img", b"c" * 1000)
        _member(tf, "checkpoint/snapguard-manifest.json", b'{"files": {}}')
        _member(tf, "checkpoint/snapguard-complete.json", b"{}")
    return path
