"""`snapguard install`: put snapguard on a node, the counterpart of `nvidia-ctk runtime configure`.

What it changes, each file written whole (snapguard.files.write_atomic), root's, 0644:

- a containerd drop-in, `<conf.d>/99-<name>.toml` beside containerd's main config, that adds the
  CRI runtime `<name>` (default `snapguard`): containerd's default runtime (a runc v2 shim) with
  `BinaryName` = this install's snapguard-runc, every other setting (SystemdCgroup, Root,
  runtime_path, ...) kept, as nvidia-ctk derives its runtime from runc's. A Kubernetes RuntimeClass
  whose `handler` is `<name>` selects it (the manifest is printed).
- the main config's `imports`, where it does not import the drop-in yet (containerd 1.6/1.7 import
  nothing by default, 2.1 neither): the drop-in's path is appended, nothing else changes. A node
  without a main config gets a minimal one (`version` and `imports`).
- with `--store URL`, a systemd drop-in for containerd's unit giving it SNAPGUARD_STORE, the image
  store a pod's restore fences its epoch in (`store_env`); without it, the plan's `next` steps
  (printed, and `next` in --json) say that containerd needs it.
- /etc/snapguard/config.toml: the pinned paths found on this node (each canonical and checked with
  snapguard.trust); keys the file already sets are kept, except `runc` where containerd's default
  runtime is NVIDIA's (`nvidia-container-runtime`): snapguard-runc then runs that, so GPU containers
  keep their devices (it forwards every verb but `create` to runc).
- snapguard-runc's C launcher (c_helpers/runc_launcher.c), where its source is installed (c_helpers/
  in a source or editable install, snapguard/_c_helpers/ in the wheel and the Debian package; --launcher
  requires it, --no-launcher leaves it out): compiled with the pinned C compiler
  (/usr/bin/cc) into `snapguard-runc-launcher` beside the Python snapguard-runc, root's, 0755, and
  the drop-in's `BinaryName`; it execs runc for every verb but checkpoint and restore without
  starting Python, and the Python snapguard-runc for those two. Beside the config, its pinned file
  (`runc-launcher.pin`: the config's runc, the config file's identity, the Python entry), which the
  config loader keeps in sync with the config. An explicit --snapguard-runc is the BinaryName as
  given, without the launcher.

The config version decides the drop-in's shape: the main config's `version` (2 for containerd 1.6
and 1.7, 3 for 2.x), or without a main config the containerd binary's (1.x: 2, 2.x: 3). The drop-in
always has the main config's version: containerd 2.x migrates the merged config by the last file's
version, so a version 3 drop-in makes it ignore a version 2 main config's CRI settings. containerd
1.x replaces a plugin's whole table with an imported file's, so for it the drop-in carries a copy of
the CRI plugin's settings as the main config and its other imports give them, plus the runtime;
containerd 2.x merges tables key by key and gets the runtime alone.

What it wrote is recorded in a root-only state file (/var/lib/snapguard/install.json): `--uninstall`
reverses exactly that (the drop-in removed, the imports entry taken out, a replaced config put
back), and leaves alone what was changed by someone else since. A second run changes nothing.
`--dry-run` prints the change as a diff and writes nothing.

The package, split by concern:

- `containerd`: reading containerd: its binary and version, the config it loads with its imports.
- `dropin`: the runtime table and the drop-in, and the main config's `imports`.
- `toml`: the TOML writer and the in-place edit of `imports`.
- `config_file`: snapguard's own config, its comments from the table of keys.
- `launcher`: the C launcher's compile with the pinned compiler, and its pinned file.
- `store_env`: containerd's SNAPGUARD_STORE, through a systemd drop-in.
- `state`: the state file, and the plan that undoes what it records (`--uninstall`).
- `configure`: plan_install(), the whole plan; `changes`: the plan's records, the diff, apply().
"""

from __future__ import annotations

from .base import DEFAULT_CONTAINERD_CONFIG as DEFAULT_CONTAINERD_CONFIG
from .base import DEFAULT_RUNTIME_NAME as DEFAULT_RUNTIME_NAME
from .base import DEFAULT_SNAPGUARD_CONFIG as DEFAULT_SNAPGUARD_CONFIG
from .base import DEFAULT_STATE_FILE as DEFAULT_STATE_FILE
from .base import DEFAULT_SYSTEMD_DIR as DEFAULT_SYSTEMD_DIR
from .base import CompilerMissingError as CompilerMissingError
from .base import InstallError as InstallError
from .changes import Change as Change
from .changes import Plan as Plan
from .changes import apply as apply
from .changes import runtimeclass_manifest as runtimeclass_manifest
from .config_file import UNWRITTEN_DEFAULTS as UNWRITTEN_DEFAULTS
from .configure import plan_install as plan_install
from .containerd import CRI_PLUGINS as CRI_PLUGINS
from .launcher import LAUNCHER_NAME as LAUNCHER_NAME
from .launcher import LAUNCHER_SOURCES as LAUNCHER_SOURCES
from .launcher import build_launcher as build_launcher
from .launcher import launcher_source_dir as launcher_source_dir
from .options import CANDIDATES as CANDIDATES
from .options import DEFAULT_CC as DEFAULT_CC
from .options import Options as Options
from .state import plan_uninstall as plan_uninstall
from .toml import dump_toml as dump_toml
from .toml import set_imports as set_imports

__all__ = ["CANDIDATES", "CRI_PLUGINS", "DEFAULT_CC", "DEFAULT_CONTAINERD_CONFIG", "DEFAULT_RUNTIME_NAME",
           "DEFAULT_SNAPGUARD_CONFIG", "DEFAULT_STATE_FILE", "DEFAULT_SYSTEMD_DIR", "LAUNCHER_NAME",
           "LAUNCHER_SOURCES", "Change", "CompilerMissingError", "InstallError", "Options", "Plan",
           "UNWRITTEN_DEFAULTS", "apply", "build_launcher", "dump_toml", "launcher_source_dir", "plan_install",
           "plan_uninstall", "runtimeclass_manifest", "set_imports"]
