"""`snapguard notice`: give the local agent a reclaim notice (operators, drains)."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
from typing import Any

from ..config import load
from ..reasons import Reason, SnapguardError
from ._base import positive_seconds, root_only

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    no = sub.add_parser("notice", help="give the local agent a reclaim notice (operators, drains)",
                        description=("Write a notice into the agent's inbox (<state_dir>/agent/inbox, atomically); "
                                     "the running agent snapshots the protected workloads on it; with no agent running it is refused "
                                     "(AGENT_NOT_RUNNING, exit 1) unless --queue. The same --id "
                                     "twice is acted on once."))
    no.add_argument("--reason", default="operator notice", metavar="TEXT", help="why (journalled)")
    no.add_argument("--id", metavar="ID", help="the notice's id (default: a new one)")
    no.add_argument("--lead", type=positive_seconds, metavar="S", help="seconds before the node goes (informational)")
    no.add_argument("--queue", action="store_true", help="post it even with no agent running (the next agent "
                    "to start acts on it); without it, no agent is AGENT_NOT_RUNNING, exit 1, nothing written")
    no.add_argument("--json", action="store_true", help="print what was written as JSON")


def agent_running(config: Any) -> bool:
    """An agent holds its state dir's lock (an exclusive flock, let go when it dies)."""
    from ..notice import agent_dir

    try:
        fd = os.open(os.path.join(agent_dir(config), "agent.lock"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file: no agent ever ran here
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing lets go of a shared lock taken just now
    return False


def run(args: argparse.Namespace) -> int:
    from ..notice import agent_dir, post_notice

    root_only("snapguard notice")
    config = load()
    if not args.queue and not agent_running(config):
        raise SnapguardError(Reason.AGENT_NOT_RUNNING, f"no agent holds {agent_dir(config)}: the notice was not "
                             "posted (--queue posts it for the next agent)")
    path = post_notice(config, args.reason, notice_id=args.id, lead_s=args.lead)
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    print(json.dumps({**doc, "path": path}) if args.json else f"snapguard notice {doc['id']} posted ({path})")
    return 0
