"""Before containerd's `runc resume` of a container: a pause that a killed executor lifted is put
back first (snapguard.runc.put_back_freezers), so that the resume finds the container paused, as
containerd's shim holds it, and the shim sees it running after. Only the `resume` verb pays for
it (a listing of the state directory's records); nothing here ever fails the pass-through."""

from __future__ import annotations

import os

from ._argv import split_global

__all__ = ["before_resume"]


def before_resume(args: list[str]) -> None:
    """`args`: runc's argv without argv[0], whose verb is `resume`."""
    try:
        opts = split_global(args)
        rest = args[opts.subcommand_index + 1:]
        if opts.subcommand != "resume" or len(rest) != 1 or rest[0].startswith("-"):
            return
        from .. import runc
        from ..config import load_with

        state_dir = load_with(os.environ, ()).state_dir
        runc.put_back_freezers(os.path.join(state_dir, "children"), rest[0], opts.root)
    except Exception:  # the boundary: runc's own resume runs whatever this met
        return
