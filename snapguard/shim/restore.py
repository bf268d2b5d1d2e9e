"""`snapguard-runc restore`: containerd's flags onto a Request; runc runs CRIU."""

from __future__ import annotations

from typing import Any

from .. import pipeline
from ..config import Config
from ._argv import GlobalOptions, SubcommandArgs
from ._criu import runc_args

__all__ = ["restore"]


def restore(config: Config, args: list[str], opts: GlobalOptions, sub: SubcommandArgs) -> dict[str, Any]:
    req = pipeline.Request(sub.image_path, sub.work_path, tcp_established=sub.flag("tcp-established"),
                           timeouts=pipeline.Timeouts.from_config(config))
    runner = pipeline.RuncRunner(config.runc, runc_args(args, opts, config), root=opts.root,
                                 container_id=sub.container_id, log=opts.log, log_format=opts.log_format, pid_file=sub.value("pid-file"))
    return pipeline.restore(runner, req, config)
