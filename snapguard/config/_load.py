"""Loading snapguard's configuration: the file, the environment, the checks of every path.

Defaults and validation come from the table of keys (snapguard.config.keys). Every path that
decides what runs as root is checked with snapguard.trust when it is loaded (root alone must
control it and every directory on the way) and replaced by the canonical path that was checked,
so that callers run exactly that.

This module is on the executor's pass-through path: it imports only os, the import-free table
and the small snapguard.trust (os, stat, errno) at module level; the TOML parser is loaded only
when a config file is parsed.
"""

from __future__ import annotations

import os

from ..trust import UntrustedPathError, check_trusted_libdir, open_trusted, resolve_trusted
from . import keys as _keys
from ._pin import sync_launcher_pin

TYPE_CHECKING = False  # typing is not imported at run time: this module is on the pass-through path
if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["Config", "ConfigError", "DEFAULTS", "DEFAULT_CONFIG_PATH", "ENV_OVERRIDES", "SWITCH_OVERRIDES",
           "TEXT_OVERRIDES",
           "check_pinned_binary", "load", "load_with", "open_config", "resolve_cuda_checkpoint"]

DEFAULT_CONFIG_PATH = _keys.DEFAULT_CONFIG_PATH
DEFAULTS: dict[str, object] = {key.name: key.default for key in _keys.KEYS}
# Path overrides, read on every load (the pass-through path reads `runc`'s).
ENV_OVERRIDES = {key.name: key.env for key in _keys.KEYS if key.kind == "path" and key.env}
# On/off settings and their environment overrides, read by load() alone (checkpoint and restore):
# the pass-through path needs none of them, so a bad value there must not fail every runc call.
SWITCH_OVERRIDES = {key.name: key.env for key in _keys.KEYS if key.kind == "switch" and key.env}
# The agent's strings and their environment overrides, read by load() alone, checked there as
# strings only: what they mean is checked by the command that uses them.
TEXT_OVERRIDES = {key.name: key.env for key in _keys.KEYS if key.kind == "text" and key.env}
_SWITCH_WORDS = _keys.SWITCH_WORDS
_PATH_KEYS = tuple(key.name for key in _keys.KEYS if key.kind == "path")
_INT_KEYS = tuple((key.name, key.high) for key in _keys.KEYS if key.kind == "int")


class ConfigError(Exception):
    """The configuration is unreadable or invalid; the message is one line.

    `reason` is the name of a snapguard.reasons.Reason member (kept a string so that the
    pass-through path need not import the enum).
    """

    def __init__(self, message: str, reason: str = "CONFIG_INVALID") -> None:
        # one line even when a path or a parser's message holds a newline: it goes to runc's log
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))
        self.reason = reason


class Config:
    """The loaded configuration; attributes are the keys of DEFAULTS."""

    runc: str
    criu: str
    criu_libdir: str
    cuda_checkpoint: str
    state_dir: str
    criu_timeout_s: int
    run_timeout_s: int
    take_wait_s: int
    cuda_broker: bool
    hash_while_dumping: bool
    restore_prefetch: bool
    cri_socket: str
    registry: str
    registry_repository: str

    def __init__(self, values: dict[str, object], source: str | None, source_stat: os.stat_result | None = None) -> None:
        self.source = source
        self.source_stat = source_stat  # the config file's fstat when it was read
        for key, value in values.items():
            setattr(self, key, value)

    def as_dict(self) -> dict[str, object]:
        return {key: getattr(self, key) for key in DEFAULTS} | {"source": self.source}


MAX_CONFIG_BYTES = 1 << 20  # a config file is a few lines; more is a mistake, not a config


def _untrusted(e: UntrustedPathError, what: str | None = None) -> ConfigError:
    """One line, naming what the path was for; a path root does not control is UNTRUSTED_PATH."""
    return ConfigError(f"{what} {e}" if what else str(e), "CONFIG_INVALID" if e.unusable else e.reason)


def open_config(path: str) -> int | None:
    """A descriptor of the checked config file, or None when it does not exist.

    Its owner chooses every binary snapguard runs as root, so it must be root's alone, and every
    directory on the way to it too; it is read through the descriptor that was checked.
    """
    if not os.path.isabs(path):
        raise ConfigError(f"the config file must be an absolute path, got {path!r}")
    try:
        return open_trusted(path, "file")
    except UntrustedPathError as e:
        if e.missing:
            return None
        raise _untrusted(e, "config file") from None


def _read_config(fd: int, path: str) -> dict[str, object]:
    """The TOML table in the file open at `fd` (closed here). Every failure is a one-line ConfigError:
    this runs on every runc call containerd makes, and a traceback there breaks every container."""
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start}") from None
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {_one_line(str(e))}") from None
    except (ValueError, RecursionError) as e:  # the parser's own limits; still a bad file
        raise ConfigError(f"{path} is not valid TOML: {_one_line(str(e))}") from None
    unknown = sorted(set(data) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(DEFAULTS)}")
    return data


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _trusted_binary(key: str, path: str) -> str:
    """The canonical path of a pinned binary; a missing (or not executable) one is kept as given,
    preflight reports it when a snapshot needs it, but one that root does not control is an error
    now."""
    try:
        return resolve_trusted(path, "exec")
    except UntrustedPathError as e:
        if e.unusable:
            return path
        raise _untrusted(e, f"`{key}`") from None


def _trusted_libdir(path: str) -> str:
    """CRIU loads every *.so in its libdir as root: the directory and each plugin must be root's.

    A libdir that does not exist (or is no directory) is kept as given: CRIU then loads nothing
    and preflight reports the missing CUDA plugin. A plugin that fails in any way is an error,
    since the plugins after it in the directory would go unchecked.
    """
    try:
        return check_trusted_libdir(path)
    except UntrustedPathError as e:
        if e.unusable and e.path == path:
            return path
        raise _untrusted(e, "`criu_libdir`") from None


def _trusted_state_dir(path: str) -> str:
    """The state dir, canonical when it exists. A missing one is created later (make_private_dir),
    but the part that exists must already be root's: whoever controls it could swap what
    snapguard generates there."""
    try:
        return resolve_trusted(path, "dir")
    except UntrustedPathError as e:
        if e.missing:
            return path
        raise _untrusted(e, "`state_dir`") from None


def _check_switches(values: dict[str, object], env: Mapping[str, str]) -> None:
    """The on/off settings, from the file (TOML booleans) or the environment (a word each way), and
    the agent's strings, from the file or the environment."""
    for key, var in SWITCH_OVERRIDES.items():
        if env.get(var):
            word = env[var].strip().lower()
            if word not in _SWITCH_WORDS:
                raise ConfigError(f"{var} must be one of {', '.join(_SWITCH_WORDS)}, got {env[var]!r}")
            values[key] = _SWITCH_WORDS[word]
        if not isinstance(values[key], bool):
            raise ConfigError(f"`{key}` must be true or false, got {values[key]!r}")
    for key, var in TEXT_OVERRIDES.items():
        if env.get(var):
            values[key] = env[var]
        if not isinstance(values[key], str) or "\0" in values[key] or len(values[key]) > 4096:
            raise ConfigError(f"`{key}` must be a string (at most 4096 characters), got {values[key]!r:.80}")


def load_with(env: Mapping[str, str], check: tuple[str, ...], switches: bool = False) -> Config:
    """The configuration with only the paths in `check` checked (and the switches read with
    `switches`): the pass-through path checks `runc` alone."""
    path = env.get(_keys.CONFIG_ENV) or DEFAULT_CONFIG_PATH
    values: dict[str, object] = dict(DEFAULTS)
    source = None
    source_stat = None
    fd = open_config(path)
    if fd is not None:
        try:
            source_stat = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise ConfigError(f"cannot read {path}: {e.strerror}") from None
        values.update(_read_config(fd, path))
        source = path
    elif _keys.CONFIG_ENV in env:
        raise ConfigError(f"{_keys.CONFIG_ENV} names {path}, which does not exist")
    for key, var in ENV_OVERRIDES.items():
        if env.get(var):
            values[key] = env[var]
    for key in _PATH_KEYS:
        value = values[key]
        if not isinstance(value, str) or not os.path.isabs(value):
            raise ConfigError(f"`{key}` must be an absolute path, got {value!r}")
    for key, high in _INT_KEYS:
        value = values[key]
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
            raise ConfigError(f"`{key}` must be an integer from 1 to {high}, got {value!r}")
    if switches:
        _check_switches(values, env)
    for key in check:
        value = str(values[key])
        if key == "criu_libdir":
            values[key] = _trusted_libdir(value)
        elif key == "state_dir":
            values[key] = _trusted_state_dir(value)
        else:
            values[key] = _trusted_binary(key, value)
    return Config(values, source, source_stat)


def load(environ: Mapping[str, str] | None = None) -> Config:
    """Defaults, then the config file, then environment overrides; every path must be absolute.

    Every path is checked now (see snapguard.trust): the config file, the binaries, CRIU's libdir
    with each plugin in it and the existing part of the state dir must be root's alone, every
    directory on the way included. The binaries and the libdir are then the canonical paths that
    were checked, so callers run exactly what was checked. Binaries and a libdir that do not exist
    are kept as given (preflight reports them); one that root does not control is a ConfigError
    with reason UNTRUSTED_PATH. No exception but ConfigError comes out of here.
    """
    env = os.environ if environ is None else environ
    config = load_with(env, _PATH_KEYS, switches=True)
    if config.source is not None and config.source_stat is not None and not env.get(ENV_OVERRIDES["runc"]):
        sync_launcher_pin(config.source, config.source_stat, config.runc)
    return config


def resolve_cuda_checkpoint(config: Config) -> str | None:
    """The cuda-checkpoint CRIU's plugin will run, canonical and checked: NVIDIA's where installed
    at the pinned path, else snapguard's own (snapguard-cuda-checkpoint, installed beside this
    interpreter). None when neither exists as an executable root alone controls: CRIU's plugin
    runs it as root, so an unchecked one must never be linked where the plugin finds it."""
    import sys

    for candidate in (config.cuda_checkpoint,
                      os.path.join(os.path.dirname(sys.executable), "snapguard-cuda-checkpoint")):
        try:
            return resolve_trusted(candidate, "exec")
        except UntrustedPathError:
            continue
    return None


def check_pinned_binary(path: str, what: str) -> str | None:
    """Why `path` must not be executed as root, or None when it is fine (one line).

    A binary run by a root executor must be a root-owned executable file that nobody else can
    write, reached only through directories nobody else can write (snapguard.trust); otherwise
    whoever can write any of them runs code as root. Callers that go on to run it should run
    resolve_trusted(path, "exec"), the canonical path that was checked.
    """
    try:
        resolve_trusted(path, "exec")
    except UntrustedPathError as e:
        if e.unusable:
            return f"{what} {e}"
        return f"{what} {e}: it must be owned by root and writable by root alone, on a path only root can change"
    return None


