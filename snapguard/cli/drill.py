"""`snapguard drill`: hands over to `snapguard-lab drill`, the lab's command."""

from __future__ import annotations

import os
import sys
from typing import Any

from ._base import EXIT_USAGE

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    sub.add_parser("drill", help="a real snapshot drill: snapshot a live workload through containerd, runc and "
                        "CRIU and show it continued where it stopped", add_help=False,
                        description="A real snapshot drill: a counter container (or a PyTorch trainer on the GPU) "
                                    "snapshotted through containerd, snapguard-runc and CRIU, restored, and shown to "
                                    "continue where it stopped; --json [--out PATH] gives the results. Run by the "
                                    "lab package (installed beside snapguard by packaging/setup.sh): "
                                    "`snapguard drill --help` lists its flags.")


def run(lab_args: list[str]) -> int:
    """The drills live in the lab package, which the product never imports: hand over to its
    command, installed beside this one (argv untouched, so its --help and errors are its own)."""
    lab = os.path.join(os.path.dirname(sys.executable), "snapguard-lab")
    if not os.path.exists(lab):
        print(f"snapguard USAGE_ERROR: the drills need snapguard-lab, not installed at {lab} "
              "(packaging/setup.sh installs it; or pip install ./lab)", file=sys.stderr)
        return EXIT_USAGE
    os.execv(lab, [lab, "--prog=snapguard", "drill", *lab_args])  # its --help says `usage: snapguard drill`
