"""OCI checkpoint images: a CRI checkpoint archive published where a replacement pod can use it.

containerd 2.x (internal/cri/server/container_checkpoint_linux.go) restores a container whose
CreateContainer image is an image in its store whose manifest carries the annotation
`org.criu.checkpoint.container.name` (checkpointctl's CheckpointAnnotationName, the one CRI-O's
checkpoint images carry too): it views the image's one layer and copies it as the checkpoint
directory, so the layer is the archive CheckpointContainer wrote, as it is (config.dump,
spec.dump, status.dump, rootfs-diff.tar, checkpoint/ with CRIU's images and snapguard's seal).

    image = build_image(archive, job="train-1", epoch=3)   # checks the archive; config, manifest
    pushed = push_image(image, "http://registry:5000", "ckpt/train-1", "e3", deadline_s=60)
    pushed.reference  # registry:5000/ckpt/train-1@sha256:...  (what the pod spec names)

    out = publish_archive(archive, "http://registry:5000", "ckpt/train-1", "e3", job="train-1", epoch=3,
                          deadline_s=60)   # the same, reading the archive's bytes once (the agent's)
    out.image.parts, out.pushed.reference, out.timings

Failures are SnapguardError with a typed reason: CHECKPOINT_ARCHIVE_INVALID, REGISTRY_UNREACHABLE,
REGISTRY_TOO_SLOW, REGISTRY_DIGEST_MISMATCH.
"""

from __future__ import annotations

from ._image import ANNOTATION_CONTAINER, CheckpointImage, ImageParts, build_image
from ._push import Published, Pushed, publish_archive, push_image

__all__ = ["ANNOTATION_CONTAINER", "CheckpointImage", "ImageParts", "Published", "Pushed", "build_image",
           "publish_archive", "push_image"]
