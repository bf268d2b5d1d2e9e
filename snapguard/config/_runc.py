"""The real runc's path for the pass-through path, and its cache in the state dir.

pinned_runc() runs on every runc call containerd makes: it raises nothing but ConfigError and
stays cheap, reading the runc path from a root-only cache keyed by the config file's identity and
parsing the config only when that misses.
"""

from __future__ import annotations

import os

from ..trust import UntrustedPathError, make_private_dir, open_trusted, resolve_trusted
from . import keys as _keys
from ._load import DEFAULT_CONFIG_PATH, DEFAULTS, ENV_OVERRIDES, ConfigError, load_with, open_config
from ._pin import sync_launcher_pin

TYPE_CHECKING = False  # typing is not imported at run time: this module is on the pass-through path
if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["RUNC_CACHE", "pinned_runc"]

RUNC_CACHE = "runc-path.cache"


def _cache_dir(env: Mapping[str, str]) -> str:
    return env.get(ENV_OVERRIDES["state_dir"]) or str(DEFAULTS["state_dir"])


def _config_stamp(st: os.stat_result, path: str) -> str:
    """What identifies this version of the config file: a rewrite or replacement changes it."""
    return f"{path}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _cached_runc(state_dir: str, stamp: str) -> str | None:
    """The runc path remembered for this exact config file, if a cache root alone controls holds it."""
    try:
        fd = open_trusted(os.path.join(state_dir, RUNC_CACHE), "file")
    except UntrustedPathError:
        return None  # missing, or planted by someone else: parse the config instead
    try:
        with os.fdopen(fd, "rb") as f:
            text = f.read(8192).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    cached_stamp, _, runc = text.rstrip("\n").partition("\n")
    return runc if cached_stamp == stamp and runc else None


def _remember_runc(state_dir: str, stamp: str, runc: str) -> None:
    """Write the cache in the private state dir (created 0700 if missing), atomically."""
    from ..files import write_atomic  # only on a miss: the pass-through path stays small

    try:
        directory = make_private_dir(state_dir)
        write_atomic(os.path.join(directory, RUNC_CACHE), f"{stamp}\n{runc}\n".encode("utf-8", "surrogateescape"))
    except (OSError, UntrustedPathError):
        pass  # a cache that cannot be written only costs the next call a parse


def _checked_runc(runc: str) -> str:
    """The canonical runc to exec; missing or not executable is RUNC_UNUSABLE, a runc that root
    does not control alone is UNTRUSTED_PATH."""
    try:
        return resolve_trusted(runc, "exec")
    except UntrustedPathError as e:
        raise ConfigError(f"runc {e}", "RUNC_UNUSABLE" if e.unusable else e.reason) from None


def pinned_runc(environ: Mapping[str, str] | None = None) -> str:
    """The real runc's canonical path, for the pass-through path: the cheapest source first.

    This runs on every runc call containerd makes, so it raises nothing but ConfigError (a
    traceback here breaks every container on the node) and stays cheap: parsing TOML costs more
    than runc itself takes to answer `state`, so the path read from the config file is cached
    (root-only, in the state dir) under the file's identity, and tomllib is imported only when
    the cache misses. The config file is checked on every call all the same (a walk of a few
    fstat calls): its owner chooses runc. Only runc is checked here; the other binaries matter
    only to checkpoint and restore, which load() the whole configuration.
    """
    env = os.environ if environ is None else environ
    runc = env.get(ENV_OVERRIDES["runc"])
    if runc:
        if not os.path.isabs(runc):
            raise ConfigError(f"{ENV_OVERRIDES['runc']} must be an absolute path, got {runc!r}")
        return _checked_runc(runc)
    config_path = env.get(_keys.CONFIG_ENV) or DEFAULT_CONFIG_PATH
    fd = open_config(config_path)
    if fd is None:
        return _checked_runc(load_with(env, ("runc",)).runc)
    try:
        st = os.fstat(fd)
    except OSError as e:
        raise ConfigError(f"cannot read {config_path}: {e.strerror}") from None
    finally:
        os.close(fd)
    stamp = _config_stamp(st, config_path)
    state_dir = _cache_dir(env)
    runc = _cached_runc(state_dir, stamp)
    if runc is None:
        config = load_with(env, ("runc",))
        runc = config.runc
        if config.source_stat is not None:  # what was parsed: the file may have changed since the fstat
            st = config.source_stat
            stamp = _config_stamp(st, config_path)
        _remember_runc(state_dir, stamp, runc)
    sync_launcher_pin(config_path, st, runc)
    return _checked_runc(runc)


