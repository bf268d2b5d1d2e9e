"""Reclaim notices and the node agent that acts on them (`snapguard agent`, `notice`, `protect`).

Sources (`_sources`) read one capacity owner's notice each, in the format it documents: AWS spot
`instance-action` (IMDSv2), GCE `preempted` and `maintenance-event`, Azure Scheduled Events
`Preempt`, a Kubernetes watch of the node (reclaim taints, a shutdown) and of its opted-in pods
(`DisruptionTarget`), and the local inbox `snapguard notice` writes; each exchange with a peer
has one deadline, and what a peer sends is parsed with bounds and checked against a schema. The
agent (`_agent`; its state on disk in `_state`, restart in `_recover`, uploads in `_upload`, warm
host checks in `_warm`) takes one stopping snapshot through
snapguard.pipeline of each workload registered with `snapguard protect`, once per notice, into a
private local directory and, with a store URL, into the image store (snapguard.store, optional).
"""

from __future__ import annotations

from ._agent import Agent as Agent
from ._state import check_job as check_job
from ._containerd import DEFAULT_ADDRESS as DEFAULT_ADDRESS
from ._containerd import DEFAULT_CTR as DEFAULT_CTR
from ._containerd import DEFAULT_RUNC_ROOT as DEFAULT_RUNC_ROOT
from ._containerd import ContainerdWatch as ContainerdWatch
from ._cripods import CriPods as CriPods
from ._sources import AWS_URL as AWS_URL
from ._sources import AZURE_URL as AZURE_URL
from ._sources import GCE_URL as GCE_URL
from ._sources import K8S_CA as K8S_CA
from ._sources import K8S_TOKEN as K8S_TOKEN
from ._sources import K8S_URL as K8S_URL
from ._sources import SOURCE_NAMES as SOURCE_NAMES
from ._sources import AwsSpot as AwsSpot
from ._sources import Azure as Azure
from ._sources import Gce as Gce
from ._sources import SOURCE_ALIASES as SOURCE_ALIASES
from ._sources import KubeNode as KubeNode
from ._sources import KubePods as KubePods
from ._sources import default_url as k8s_default_url
from ._sources import kubernetes_sources as kubernetes_sources
from ._sources import Local as Local
from ._sources import Notice as Notice
from ._sources import Source as Source
from ._state import Registry as Registry
from ._state import agent_dir as agent_dir
from ._state import local_source as local_source
from ._state import post_notice as post_notice
from ._state import read_journal as read_journal
from ._upload import ImageStore as ImageStore

__all__ = [
    "AWS_URL", "AZURE_URL", "DEFAULT_ADDRESS", "DEFAULT_CTR", "DEFAULT_RUNC_ROOT", "GCE_URL", "K8S_CA",
    "K8S_TOKEN", "K8S_URL", "SOURCE_ALIASES", "SOURCE_NAMES", "Agent", "ContainerdWatch", "CriPods", "AwsSpot", "Azure", "Gce",
    "ImageStore", "KubeNode", "KubePods", "Local", "Notice", "Registry", "Source", "agent_dir", "check_job", "k8s_default_url",
    "kubernetes_sources", "local_source", "post_notice", "read_journal",
]
