"""Running the real runc for the guarded verbs, and what both verbs check first."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from .. import criu
from ..config import Config
from ..reasons import Reason, SnapguardError
from ._argv import GlobalOptions

__all__ = ["criu_path", "prepared_env", "run_real", "runc_command", "runc_state"]


def criu_path(opts: GlobalOptions, config: Config) -> str:
    """The CRIU runc will run: containerd's CriuPath option if set, else snapguard's pinned one."""
    return opts.criu or config.criu


def runc_command(runc: str, args: list[str], opts: GlobalOptions, config: Config) -> list[str]:
    """argv for the real runc: unchanged, but for the pinned CRIU when the caller named none."""
    if opts.criu:
        return [runc, *args]
    return [runc, "--criu", config.criu, *args]


def runc_state(runc: str, opts: GlobalOptions, container_id: str) -> dict[str, Any]:
    argv = [runc]
    if opts.root:
        argv += ["--root", opts.root]
    argv += ["state", container_id]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if out.returncode != 0:
        raise SnapguardError(Reason.CONTAINER_NOT_FOUND,
                             f"runc state {container_id}: {out.stderr.strip().splitlines()[-1:] or 'failed'}",
                             evidence={"container": container_id, "root": opts.root})
    try:
        state = json.loads(out.stdout)
        int(state["pid"])
    except (ValueError, KeyError, TypeError):
        raise SnapguardError(Reason.CONTAINER_NOT_FOUND, f"runc state {container_id} printed no pid",
                             evidence={"container": container_id}) from None
    return state


def run_real(argv: list[str], env: dict[str, str]) -> int:
    # close_fds=False: containerd hands runc the container's stdio and sockets by fd inheritance.
    return subprocess.run(argv, env=env, close_fds=False, check=False).returncode


def prepared_env(config: Config, criu_bin: str) -> dict[str, str]:
    return criu.prepare_environment(config, criu_bin)
