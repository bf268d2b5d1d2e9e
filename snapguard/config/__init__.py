"""snapguard's configuration: pinned paths of the binaries it runs as root, and its settings.

Read from /etc/snapguard/config.toml (or the file named by $SNAPGUARD_CONFIG); single values can be
overridden by environment variables (containerd passes its environment down to the executor).
No binary is ever looked up in $PATH: every path is absolute and checked before use. The keys,
their types, defaults and environment variables are one table, `keys`.

- `_load`: load() and load_with(): the file, the environment, the checks; Config, ConfigError.
- `_runc`: pinned_runc(), the pass-through path's runc, cached in the state dir.
- `_pin`: the C launcher's pinned file beside the config.

This package is imported on the executor's pass-through path: its modules import only os and
snapguard.trust at module level.
"""

from __future__ import annotations

from ._load import DEFAULT_CONFIG_PATH as DEFAULT_CONFIG_PATH
from ._load import DEFAULTS as DEFAULTS
from ._load import ENV_OVERRIDES as ENV_OVERRIDES
from ._load import SWITCH_OVERRIDES as SWITCH_OVERRIDES
from ._load import TEXT_OVERRIDES as TEXT_OVERRIDES
from ._load import Config as Config
from ._load import ConfigError as ConfigError
from ._load import check_pinned_binary as check_pinned_binary
from ._load import load as load
from ._load import load_with as load_with
from ._load import resolve_cuda_checkpoint as resolve_cuda_checkpoint
from ._pin import LAUNCHER_PIN_HEADER as LAUNCHER_PIN_HEADER
from ._pin import LAUNCHER_PIN_NAME as LAUNCHER_PIN_NAME
from ._pin import launcher_pin_path as launcher_pin_path
from ._pin import pin_stamp as pin_stamp
from ._pin import read_launcher_pin as read_launcher_pin
from ._pin import render_launcher_pin as render_launcher_pin
from ._pin import sync_launcher_pin as sync_launcher_pin
from ._pin import write_pin_file as write_pin_file
from ._runc import RUNC_CACHE as RUNC_CACHE
from ._runc import pinned_runc as pinned_runc

__all__ = ["DEFAULTS", "DEFAULT_CONFIG_PATH", "ENV_OVERRIDES", "LAUNCHER_PIN_HEADER", "LAUNCHER_PIN_NAME",
           "RUNC_CACHE", "SWITCH_OVERRIDES", "TEXT_OVERRIDES", "Config", "ConfigError", "check_pinned_binary",
           "launcher_pin_path",
           "load", "load_with", "pin_stamp", "pinned_runc", "read_launcher_pin", "render_launcher_pin",
           "resolve_cuda_checkpoint", "sync_launcher_pin", "write_pin_file"]
