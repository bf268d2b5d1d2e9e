"""File names snapguard reads and writes in image and work directories, in one place.

`checkpoint/` of a kubelet checkpoint archive holds CRIU's images and these files, beside
checkpointctl's own names (config.dump, spec.dump, ...), which none of these collide with.
"""

import re

__all__ = ["DUMP_LOG", "MANIFEST_NAME", "MARKER_NAME", "NOT_IMAGE_FILES", "RESTORED_PIDFILE", "RESTORE_LOG",
           "RESULT_NAME", "TAKE_SPILL", "take_spill_name"]

MANIFEST_NAME = "snapguard-manifest.json"
MARKER_NAME = "snapguard-complete.json"  # written last: its presence means the image is whole
RESULT_NAME = "snapguard-result.json"  # the record of a run, success or failure, in the work dir
DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
RESTORED_PIDFILE = "restored.pid"
# In an image directory but not part of what was dumped: snapguard's own files, and what a
# restore adds there (CRIU writes stats-restore into the images directory at every restore).
NOT_IMAGE_FILES = frozenset({MANIFEST_NAME, MARKER_NAME, RESULT_NAME, RESTORE_LOG, RESTORED_PIDFILE,
                             "stats-restore"})


TAKE_SPILL = re.compile(r"snapguard-take-[0-9]+\.bin")  # take_spill_name's, and only those
# The take point's own spill files (before the executor writes them into an image) are named
# in snapguard.takepoint.protocol (TAKE_SPILL_SOURCE), which the trainer's side imports alone.


def take_spill_name(pid: int) -> str:
    """The image file that holds the bytes pid's take point moved into a file of its own (its
    spill), written by the executor, not by CRIU; the manifest's take_point names it."""
    return f"snapguard-take-{pid}.bin"
