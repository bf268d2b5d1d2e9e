"""`snapguard-runc restore`: containerd's flags onto a Request; runc runs CRIU.

`--from URL` (with `--from-job J`, `--from-image NAME`), snapguard's own and only right after the
verb, restores from an image store: the job's newest whole image is fetched into --image-path (a
new or empty directory), verified as it is written, and runc restores it with those flags taken
out, the job's next fencing epoch taken as the last step before runc's restore and rolled back if
that restore fails (`pipeline.run_fenced`); the host checks of the restore's preflight run while the
image is fetched (`pipeline.fetch_fenced`). A refusal names the job's file checkpoint, when one is
registered, in the failure record's evidence. SNAPGUARD_RENDEZVOUS (HOST:PORT) in the shim's
environment is where the restored ranks' process groups rebuild their store, as `snapguard restore
--rendezvous` says. Without `--from`, a pod's container created from a checkpoint image whose
bundle carries the webhook's `snapguard.io/epoch` takes that attempt's epoch in the store named
by SNAPGUARD_STORE the same way (snapguard.pipeline.pod_fence).
"""

from __future__ import annotations

import os
from typing import Any

from .. import pipeline
from ..pipeline import pod_fence, run_pod_fenced
from ..config import Config
from ..reasons import Reason, SnapguardError
from ..takepoint import protocol
from ._argv import OWN_RESTORE_FLAGS, GlobalOptions, SubcommandArgs, parse_subcommand
from ._criu import runc_args

__all__ = ["restore"]


def _rendezvous() -> str | None:
    text = os.environ.get(protocol.RENDEZVOUS_ENV, "").strip()
    if not text:
        return None
    try:
        host, port = protocol.parse_rendezvous(text)
    except ValueError as e:
        raise SnapguardError(Reason.USAGE_ERROR, f"{protocol.RENDEZVOUS_ENV}: {e}") from None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def restore(config: Config, args: list[str], opts: GlobalOptions, sub: SubcommandArgs) -> dict[str, Any]:
    url = sub.value("from")
    verified: tuple[tuple[str, str, int, int], ...] = ()
    fetched = None
    if url:
        args = _without_own_flags(args, opts)
        fetched = pipeline.fetch_fenced(url, config, job=sub.value("from-job"), image=sub.value("from-image"),
                                        images=sub.image_path, defer_epoch=True)
        verified = fetched.verified
    elif sub.value("from-job") or sub.value("from-image"):
        raise SnapguardError(Reason.USAGE_ERROR, "restore: --from-job and --from-image need --from URL")
    req = pipeline.Request(sub.image_path, sub.work_path, tcp_established=sub.flag("tcp-established"),
                           verified_digests=verified, timeouts=pipeline.Timeouts.from_config(config),
                           rendezvous=_rendezvous())
    runner = pipeline.RuncRunner(config.runc, runc_args(args, opts, config), root=opts.root,
                                 container_id=sub.container_id, log=opts.log, log_format=opts.log_format,
                                 pid_file=sub.value("pid-file"))
    fence = pod_fence(sub.value("bundle")) if fetched is None else None
    try:
        if fetched is not None:  # the epoch is taken right before CRIU, rolled back if the restore fails
            result = pipeline.run_fenced(fetched, runner, req, config)
        elif fence is not None:  # the pod's epoch (the webhook's), taken the same way
            result = run_pod_fenced(fence, runner, req, config)
        else:
            result = pipeline.restore(runner, req, config)
    except SnapguardError as e:
        if fetched is not None:
            pipeline.mark_fallback(e, fetched.job, fetched.fallback)
        raise
    if fetched is not None:
        result.update(fetched.summary())
    return result


def _without_own_flags(args: list[str], opts: GlobalOptions) -> list[str]:
    """runc's argv without snapguard's restore flags, which must come first after the verb (so
    that what is taken out is what was parsed, never a value of one of runc's flags)."""
    head, rest = args[:opts.subcommand_index + 1], args[opts.subcommand_index + 1:]
    i = 0
    while i < len(rest) and rest[i].startswith("-") and rest[i] != "--":
        name, eq, _ = rest[i].lstrip("-").partition("=")
        if name not in OWN_RESTORE_FLAGS:
            break
        i += 1 if eq else 2
    left = rest[i:]
    if any(parse_subcommand("restore", left).value(f) for f in OWN_RESTORE_FLAGS):
        raise SnapguardError(Reason.USAGE_ERROR, "restore: --from, --from-job and --from-image come right after "
                             "`restore`, before runc's flags")
    return head + left
