"""What `snapguard install` is asked to do: its options, one record the CLI fills."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .base import (DEFAULT_CONTAINERD_CONFIG, DEFAULT_RUNTIME_NAME, DEFAULT_SNAPGUARD_CONFIG, DEFAULT_STATE_FILE,
                   DEFAULT_SYSTEMD_DIR)

__all__ = ["CANDIDATES", "DEFAULT_CC", "Options"]

# Where each pinned path is looked for, first found wins (runc: after containerd's own choice).
CANDIDATES = {
    "runc": ("/usr/sbin/runc", "/usr/bin/runc", "/usr/local/sbin/runc", "/usr/local/bin/runc"),
    "criu": ("/usr/local/sbin/criu", "/usr/sbin/criu", "/usr/local/bin/criu", "/usr/bin/criu"),
    "criu_libdir": ("/usr/local/lib/criu", "/usr/lib/criu", "/usr/lib/x86_64-linux-gnu/criu"),
    "cuda_checkpoint": ("/usr/local/bin/cuda-checkpoint", "/usr/bin/cuda-checkpoint"),
}
# the pinned C compiler that builds snapguard-runc's launcher
DEFAULT_CC = "/usr/bin/cc"


@dataclass
class Options:
    """The flags of `snapguard install`; the defaults are a node's usual paths."""

    containerd_config: str = DEFAULT_CONTAINERD_CONFIG
    dropin_dir: str | None = None  # default: conf.d beside the main config
    snapguard_config: str = DEFAULT_SNAPGUARD_CONFIG
    state_file: str = DEFAULT_STATE_FILE
    runtime_name: str = DEFAULT_RUNTIME_NAME
    containerd: str | None = None  # the containerd binary, for its version
    snapguard_runc: str | None = None  # default: beside this interpreter
    # the C launcher: None builds it where its source is found unless snapguard_runc is given
    # (then BinaryName is that, as given); True requires it, False leaves it out
    launcher: bool | None = None
    launcher_path: str | None = None  # default: snapguard-runc-launcher beside snapguard-runc
    cc: str = DEFAULT_CC
    store: str | None = None  # SNAPGUARD_STORE for containerd: a systemd drop-in (install.store_env)
    systemd_dir: str = DEFAULT_SYSTEMD_DIR
    candidates: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(CANDIDATES))

    @property
    def dropin_path(self) -> str:
        directory = self.dropin_dir or os.path.join(os.path.dirname(self.containerd_config), "conf.d")
        return os.path.join(directory, f"99-{self.runtime_name}.toml")
