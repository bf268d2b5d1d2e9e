"""snapguard's configuration: pinned paths of the binaries it runs as root.

Read from /etc/snapguard/config.toml (or the file named by $SNAPGUARD_CONFIG); single values can be
overridden by environment variables (containerd passes its environment down to the executor).
No binary is ever looked up in $PATH: every path is absolute and checked before use.

This module is imported on the executor's pass-through path, so it imports only os and sys at
module level; the TOML parser is loaded only when a config file exists.
"""

from __future__ import annotations

import os
import stat

TYPE_CHECKING = False  # typing is not imported at run time: this module is on the pass-through path
if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["Config", "ConfigError", "load", "pinned_runc", "check_pinned_binary", "resolve_cuda_checkpoint"]

DEFAULT_CONFIG_PATH = "/etc/snapguard/config.toml"

DEFAULTS = {
    "runc": "/usr/sbin/runc",
    "criu": "/usr/local/sbin/criu",
    "criu_libdir": "/usr/local/lib/criu",
    # Where cuda-checkpoint is looked for: NVIDIA's binary first, then snapguard's own.
    "cuda_checkpoint": "/usr/local/bin/cuda-checkpoint",
    "state_dir": "/run/snapguard",
    "criu_timeout_s": 60,
    # how long a snapshot waits for the workload's take point before going on without it
    "take_wait_s": 10,
}

ENV_OVERRIDES = {
    "runc": "SNAPGUARD_RUNC",
    "criu": "SNAPGUARD_CRIU",
    "criu_libdir": "SNAPGUARD_CRIU_LIBDIR",
    "cuda_checkpoint": "SNAPGUARD_CUDA_CHECKPOINT",
    "state_dir": "SNAPGUARD_STATE_DIR",
}

_PATH_KEYS = ("runc", "criu", "criu_libdir", "cuda_checkpoint", "state_dir")


class ConfigError(Exception):
    """The configuration is unreadable or invalid; the message is one line.

    `reason` is the name of a snapguard.reasons.Reason member (kept a string so that the
    pass-through path need not import the enum).
    """

    def __init__(self, message: str, reason: str = "CONFIG_INVALID") -> None:
        super().__init__(message)
        self.reason = reason


class Config:
    """The loaded configuration; attributes are the keys of DEFAULTS."""

    runc: str
    criu: str
    criu_libdir: str
    cuda_checkpoint: str
    state_dir: str
    criu_timeout_s: int
    take_wait_s: int

    def __init__(self, values: dict[str, object], source: str | None) -> None:
        self.source = source
        for key, value in values.items():
            setattr(self, key, value)

    def as_dict(self) -> dict[str, object]:
        return {key: getattr(self, key) for key in DEFAULTS} | {"source": self.source}


def _read_file(path: str) -> dict[str, object]:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(DEFAULTS)}")
    return data


def load(environ: Mapping[str, str] | None = None) -> Config:
    """Defaults, then the config file, then environment overrides; every path must be absolute."""
    env = os.environ if environ is None else environ
    path = env.get("SNAPGUARD_CONFIG") or DEFAULT_CONFIG_PATH
    values: dict[str, object] = dict(DEFAULTS)
    source = None
    if os.path.exists(path):
        values.update(_read_file(path))
        source = path
    elif "SNAPGUARD_CONFIG" in env:
        raise ConfigError(f"SNAPGUARD_CONFIG names {path}, which does not exist")
    for key, var in ENV_OVERRIDES.items():
        if env.get(var):
            values[key] = env[var]
    for key in _PATH_KEYS:
        value = values[key]
        if not isinstance(value, str) or not os.path.isabs(value):
            raise ConfigError(f"`{key}` must be an absolute path, got {value!r}")
    for key, high in (("criu_timeout_s", 3600), ("take_wait_s", 600)):
        value = values[key]
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
            raise ConfigError(f"`{key}` must be an integer from 1 to {high}, got {value!r}")
    return Config(values, source)


def resolve_cuda_checkpoint(config: Config) -> str | None:
    """The cuda-checkpoint CRIU's plugin will run: NVIDIA's where installed at the pinned path,
    else snapguard's own (snapguard-cuda-checkpoint, installed beside this interpreter)."""
    import sys

    for candidate in (config.cuda_checkpoint,
                      os.path.join(os.path.dirname(sys.executable), "snapguard-cuda-checkpoint")):
        if os.path.exists(candidate):
            return candidate
    return None


def check_pinned_binary(path: str, what: str) -> str | None:
    """Why `path` must not be executed as root, or None when it is fine.

    A binary run by a root executor must be a root-owned regular file that nobody else can
    write; otherwise whoever can write it runs code as root.
    """
    try:
        st = os.stat(path)
    except OSError as e:
        return f"{what} {path}: {e.strerror}"
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o111:
        return f"{what} {path} is not an executable file"
    if os.geteuid() == 0 and (st.st_uid != 0 or st.st_mode & 0o022):
        return f"{what} {path} must be owned by root and writable by root alone"
    return None


def _cache_path(env: Mapping[str, str]) -> str:
    return os.path.join(env.get("SNAPGUARD_STATE_DIR") or str(DEFAULTS["state_dir"]), "runc-path.cache")


def _config_stamp(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{path}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _cached_runc(cache: str, stamp: str) -> str | None:
    """The runc path remembered for this exact config file, if a root-only cache holds it."""
    try:
        fd = os.open(cache, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return None
        cached_stamp, _, runc = f.read(8192).rstrip("\n").partition("\n")
    return runc if cached_stamp == stamp and runc else None


def _remember_runc(cache: str, stamp: str, runc: str) -> None:
    try:
        os.makedirs(os.path.dirname(cache), mode=0o700, exist_ok=True)
        tmp = f"{cache}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{stamp}\n{runc}\n")
        os.replace(tmp, cache)
    except OSError:
        pass  # a cache that cannot be written only costs the next call a parse


def pinned_runc(environ: Mapping[str, str] | None = None) -> str:
    """The real runc's path, for the pass-through path: the cheapest source first.

    Parsing TOML costs more than runc itself takes to answer `state`, so the path read from the
    config file is cached (root-only, in the state dir) under the file's inode, size and mtime.
    """
    env = os.environ if environ is None else environ
    runc = env.get("SNAPGUARD_RUNC")
    if not runc:
        config_path = env.get("SNAPGUARD_CONFIG") or DEFAULT_CONFIG_PATH
        stamp = _config_stamp(config_path)
        cache = _cache_path(env)
        runc = _cached_runc(cache, stamp) if stamp else None
        if runc is None:
            runc = load(env).runc
            if stamp:
                _remember_runc(cache, stamp, runc)
    elif not os.path.isabs(runc):
        raise ConfigError(f"SNAPGUARD_RUNC must be an absolute path, got {runc!r}")
    problem = check_pinned_binary(runc, "runc")
    if problem:
        raise ConfigError(problem, "RUNC_UNUSABLE")
    return runc
