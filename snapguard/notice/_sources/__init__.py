"""Notice sources: each reads one capacity owner's reclaim notice in the format its owner documents.

Every source has `poll(deadline) -> Notice | None`, where `deadline` is a `time.monotonic()` bound
the whole exchange with its peer never outlives (snapguard.notice._sources._http: connect, headers,
body, a byte at a time or not), and no more than half the source's documented lead (`lead_s`). A
source that cannot be read raises SnapguardError NOTICE_SOURCE_UNAVAILABLE with the underlying
message; one that answers outside its documented format (too large, nested too deep, not of its
schema: `_parse`, `_schemas`) raises NOTICE_MALFORMED. A source that reads many items (the inbox,
a Kubernetes watch) refuses a bad one, records it (`take()`: the agent journals each) and goes on.
A source with `window_s` (a watch) is given that long a round rather than the poll interval.

- `cloud`: AWS spot `instance-action` (IMDSv2), GCE `preempted` / `maintenance-event`, Azure
  Scheduled Events.
- `kubernetes`: list+watch of this node (reclaim taints, graceful shutdown) and of its opted-in
  pods (`DisruptionTarget`), with the service account's token and CA.
- `inbox`: the files `snapguard notice` writes into the agent's inbox.
"""

from __future__ import annotations

from ._base import Notice, Refusals, Source, bounded, with_deadline
from .cloud import AWS_URL, AZURE_URL, GCE_URL, LEADS, AwsSpot, Azure, Gce
from .inbox import Local
from .kubernetes import (K8S_CA, K8S_TOKEN, K8S_URL, RECLAIM_TAINTS, KubeNode, KubePods, default_url,
                         kubernetes_sources)

__all__ = ["AWS_URL", "AZURE_URL", "GCE_URL", "K8S_CA", "K8S_TOKEN", "K8S_URL", "LEADS", "RECLAIM_TAINTS",
           "SOURCE_ALIASES", "SOURCE_NAMES", "AwsSpot", "Azure", "Gce", "KubeNode", "KubePods", "Local", "Notice",
           "Refusals", "Source", "bounded", "default_url", "kubernetes_sources", "with_deadline"]

SOURCE_NAMES = ("aws", "gce", "azure", "kubernetes", "local")
# other names a user may know a source by: GCP for GCE, k8s for Kubernetes
SOURCE_ALIASES = {"gcp": "gce", "k8s": "kubernetes"}
