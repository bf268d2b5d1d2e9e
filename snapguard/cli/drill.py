"""`snapguard drill`: hands over to `snapguard-lab drill`, the lab's command."""

from __future__ import annotations

import os
import sys
from typing import Any

from ._base import EXIT_USAGE

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    sub.add_parser("drill", help="a real snapshot drill (runs snapguard-lab drill)", add_help=False,
                        description="Hands over to `snapguard-lab drill` (the lab package, installed beside "
                                    "snapguard by packaging/setup.sh); see `snapguard-lab drill --help`.")


def run(lab_args: list[str]) -> int:
    """The drills live in the lab package, which the product never imports: hand over to its
    command, installed beside this one (argv untouched, so its --help and errors are its own)."""
    lab = os.path.join(os.path.dirname(sys.executable), "snapguard-lab")
    if not os.path.exists(lab):
        print(f"snapguard USAGE_ERROR: the drills need snapguard-lab, not installed at {lab} "
              "(packaging/setup.sh installs it; or pip install ./lab)", file=sys.stderr)
        return EXIT_USAGE
    os.execv(lab, [lab, "drill", *lab_args])
