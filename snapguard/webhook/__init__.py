"""`snapguard webhook`: the mutating admission webhook that closes the reclaim loop on Kubernetes.

The API server sends it an AdmissionReview (admission.k8s.io/v1) for every pod created that the
MutatingWebhookConfiguration selects; for a pod opted in (RuntimeClass `snapguard`, annotation
`snapguard.io/job`) it answers a JSONPatch that injects the take point (mutate.take_point_patch)
and, when the job's snapshot is restorable (snapshots.StoreSnapshots over the image store), points
the job's container at the snapshot's checkpoint image by digest and records the attempt's epoch
(mutate.restore_patch). A pod it cannot or need not change is admitted as it came, with a warning
saying why: it never refuses a pod.

    review     the AdmissionReview read (bounded, schema-checked) and the answer
    mutate     the JSONPatch of one pod
    snapshots  which checkpoint image a job's replacement pod restores from
    server     the HTTPS server (TLS from the files a Secret mounts)
"""

from __future__ import annotations

from .mutate import WebhookConfig
from .server import HEALTH_PATH, MUTATE_PATH, ServerConfig, Webhook, handle
from .snapshots import CheckpointImage, Restorable, SnapshotSource, StoreSnapshots

__all__ = ["HEALTH_PATH", "MUTATE_PATH", "CheckpointImage", "Restorable", "ServerConfig", "SnapshotSource",
           "StoreSnapshots", "Webhook", "WebhookConfig", "handle"]
