"""Which CRIU the real runc runs: the pinned one, or containerd's CriuPath when it names one."""

from __future__ import annotations

import os

from ..config import Config
from ..reasons import Reason, SnapguardError
from ..trust import UntrustedPathError, resolve_trusted
from ._argv import GlobalOptions

__all__ = ["runc_args"]


def runc_args(args: list[str], opts: GlobalOptions, config: Config) -> list[str]:
    """runc's argv (without argv[0]): containerd's, unchanged, plus `--criu` with the pinned CRIU
    when the caller named none and runc is older than 1.2 (newer runc finds CRIU through PATH
    only, which the run directory pins, and 1.4 refuses the flag). A CRIU the caller names must be the root-owned binary itself, by an absolute path
    with no link on the way, so that what is checked here is what runc runs; it then replaces the
    pinned one for this run (preflight checks it)."""
    from .. import runc

    if not opts.criu:
        if runc.version(config.runc, config.state_dir) >= runc.CRIU_BY_PATH:
            return list(args)  # CRIU by PATH only: the run directory's bin/ pins it
        return ["--criu", config.criu, *args]
    evidence = {"path": opts.criu}
    if not os.path.isabs(opts.criu):
        raise SnapguardError(Reason.USAGE_ERROR, f"--criu {opts.criu!r} is not an absolute path", evidence=evidence)
    try:
        resolved = resolve_trusted(opts.criu, "exec")
    except UntrustedPathError as e:
        if getattr(e, "missing", False):
            raise SnapguardError(Reason.CRIU_MISSING, f"--criu {opts.criu}: does not exist", evidence=evidence) from None
        raise SnapguardError(Reason.UNTRUSTED_PATH, str(e), evidence=evidence) from None
    if resolved != os.path.normpath(opts.criu):
        raise SnapguardError(Reason.UNTRUSTED_PATH, f"--criu {opts.criu} is reached through a link (to {resolved}); "
                             "name the binary itself", evidence={**evidence, "resolved": resolved})
    config.criu = resolved
    return list(args)
