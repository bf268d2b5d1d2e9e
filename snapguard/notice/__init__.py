"""Reclaim notices and the node agent that acts on them (`snapguard agent`, `notice`, `protect`).

Sources (`_sources`) read one capacity owner's notice each, in the format it documents: AWS spot
`instance-action` (IMDSv2), GCE `preempted` and `maintenance-event`, Azure Scheduled Events
`Preempt`, a Kubernetes pod's `DisruptionTarget` or its node being drained, and the local inbox
`snapguard notice` writes. The agent (`_agent`) takes one stopping snapshot through
snapguard.pipeline of each workload registered with `snapguard protect`, once per notice, into a
private local directory and, with a store URL, into the image store (snapguard.store, optional).
"""

from __future__ import annotations

from ._agent import Agent as Agent
from ._agent import ImageStore as ImageStore
from ._agent import Registry as Registry
from ._agent import agent_dir as agent_dir
from ._agent import local_source as local_source
from ._agent import post_notice as post_notice
from ._agent import read_journal as read_journal
from ._cli import COMMANDS as COMMANDS
from ._cli import add_parsers as add_parsers
from ._sources import SOURCE_NAMES as SOURCE_NAMES
from ._sources import AwsSpot as AwsSpot
from ._sources import Azure as Azure
from ._sources import Gce as Gce
from ._sources import Kubernetes as Kubernetes
from ._sources import Local as Local
from ._sources import Notice as Notice
from ._sources import Source as Source

__all__ = ["COMMANDS", "SOURCE_NAMES", "Agent", "AwsSpot", "Azure", "Gce", "ImageStore", "Kubernetes", "Local",
           "Notice", "Registry", "Source", "add_parsers", "agent_dir", "local_source", "post_notice",
           "read_journal"]
