"""snapguard's configuration: pinned paths of the binaries it runs as root.

Read from /etc/snapguard/config.toml (or the file named by $SNAPGUARD_CONFIG); single values can be
overridden by environment variables (containerd passes its environment down to the executor).
No binary is ever looked up in $PATH: every path is absolute and checked before use.

Every path that decides what runs as root is checked with snapguard.trust when it is loaded (root
alone must control it and every directory on the way) and replaced by the canonical path that was
checked, so that callers run exactly that.

This module is imported on the executor's pass-through path, so it imports only os and the small
snapguard.trust (os, stat, errno) at module level; the TOML parser is loaded only when the runc
path cache misses or a full load() runs.
"""

from __future__ import annotations

import os

from .trust import UntrustedPathError, check_trusted_libdir, make_private_dir, open_trusted, resolve_trusted

TYPE_CHECKING = False  # typing is not imported at run time: this module is on the pass-through path
if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["Config", "ConfigError", "load", "pinned_runc", "check_pinned_binary", "resolve_cuda_checkpoint",
           "launcher_pin_path", "render_launcher_pin", "read_launcher_pin", "sync_launcher_pin", "pin_stamp"]

DEFAULT_CONFIG_PATH = "/etc/snapguard/config.toml"
# The C launcher's pinned file (c_helpers/runc_launcher.c), beside the config it was derived from.
LAUNCHER_PIN_NAME = "runc-launcher.pin"
LAUNCHER_PIN_HEADER = "snapguard-runc-launcher 1"

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
    # the executor answers CRIU's CUDA plugin's cuda-checkpoint runs itself while CRIU runs
    # (snapguard.cuda.Broker): a shorter stall and restore on the H200; false runs the tool each time
    "cuda_broker": True,
    # a stop snapshot's page files are hashed while CRIU writes them
    # (snapguard.image.PageFileHasher): the seal after the dump hashes only the rest
    "hash_while_dumping": True,
    # a restore asks the kernel to read CRIU, its libraries and plugins, cuda-checkpoint and the
    # image's small files before the digest check's large reads begin (snapguard.prefetch)
    "restore_prefetch": True,
}

ENV_OVERRIDES = {
    "runc": "SNAPGUARD_RUNC",
    "criu": "SNAPGUARD_CRIU",
    "criu_libdir": "SNAPGUARD_CRIU_LIBDIR",
    "cuda_checkpoint": "SNAPGUARD_CUDA_CHECKPOINT",
    "state_dir": "SNAPGUARD_STATE_DIR",
}
# On/off settings and their environment overrides, read by load() alone (checkpoint and restore):
# the pass-through path needs none of them, so a bad value there must not fail every runc call.
SWITCH_OVERRIDES = {
    "cuda_broker": "SNAPGUARD_CUDA_BROKER_ON",
    "hash_while_dumping": "SNAPGUARD_HASH_WHILE_DUMPING_ON",
    "restore_prefetch": "SNAPGUARD_RESTORE_PREFETCH_ON",
}

_SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                 "off": False}

_PATH_KEYS = ("runc", "criu", "criu_libdir", "cuda_checkpoint", "state_dir")


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
    take_wait_s: int
    cuda_broker: bool
    hash_while_dumping: bool
    restore_prefetch: bool

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


def _open_config(path: str) -> int | None:
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
    """The on/off settings, from the file (TOML booleans) or the environment (a word each way)."""
    for key, var in SWITCH_OVERRIDES.items():
        if env.get(var):
            word = env[var].strip().lower()
            if word not in _SWITCH_WORDS:
                raise ConfigError(f"{var} must be one of {', '.join(_SWITCH_WORDS)}, got {env[var]!r}")
            values[key] = _SWITCH_WORDS[word]
        if not isinstance(values[key], bool):
            raise ConfigError(f"`{key}` must be true or false, got {values[key]!r}")


def _load(env: Mapping[str, str], check: tuple[str, ...], switches: bool = False) -> Config:
    path = env.get("SNAPGUARD_CONFIG") or DEFAULT_CONFIG_PATH
    values: dict[str, object] = dict(DEFAULTS)
    source = None
    source_stat = None
    fd = _open_config(path)
    if fd is not None:
        try:
            source_stat = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise ConfigError(f"cannot read {path}: {e.strerror}") from None
        values.update(_read_config(fd, path))
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
    config = _load(env, _PATH_KEYS, switches=True)
    if config.source is not None and config.source_stat is not None and not env.get("SNAPGUARD_RUNC"):
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


RUNC_CACHE = "runc-path.cache"


def _cache_dir(env: Mapping[str, str]) -> str:
    return env.get("SNAPGUARD_STATE_DIR") or str(DEFAULTS["state_dir"])


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
    try:
        directory = make_private_dir(state_dir)
        tmp = os.path.join(directory, f"{RUNC_CACHE}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(f"{stamp}\n{runc}\n")
        os.replace(tmp, os.path.join(directory, RUNC_CACHE))
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
    runc = env.get("SNAPGUARD_RUNC")
    if runc:
        if not os.path.isabs(runc):
            raise ConfigError(f"SNAPGUARD_RUNC must be an absolute path, got {runc!r}")
        return _checked_runc(runc)
    config_path = env.get("SNAPGUARD_CONFIG") or DEFAULT_CONFIG_PATH
    fd = _open_config(config_path)
    if fd is None:
        return _checked_runc(_load(env, ("runc",)).runc)
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
        config = _load(env, ("runc",))
        runc = config.runc
        if config.source_stat is not None:  # what was parsed: the file may have changed since the fstat
            st = config.source_stat
            stamp = _config_stamp(st, config_path)
        _remember_runc(state_dir, stamp, runc)
    sync_launcher_pin(config_path, st, runc)
    return _checked_runc(runc)


# --- the C launcher's pinned file -----------------------------------------------------------------
#
# snapguard-runc's launcher (c_helpers/runc_launcher.c) execs runc without starting Python, so it
# cannot read TOML: it reads the runc path from this file, written by `snapguard install` beside
# the config and kept in sync here, whenever the config is loaded. It records the config file's
# identity (the stamp): where the config changed since, the launcher hands the command line to
# the Python entry, whose pinned_runc() reads the config and refreshes the file.


def launcher_pin_path(config_path: str) -> str:
    """The launcher's pinned file for the config file at `config_path`."""
    return os.path.join(os.path.dirname(config_path), LAUNCHER_PIN_NAME)


def pin_stamp(st: os.stat_result) -> str:
    """The config file's identity as the launcher computes it from fstat."""
    return f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"


def render_launcher_pin(config_path: str, stamp: str, runc: str, entry: str) -> bytes:
    """The pinned file's text; ValueError where a value cannot be written on one line."""
    for value in (config_path, stamp, runc, entry):
        if not value or "\n" in value or "\0" in value:
            raise ValueError(f"cannot pin {value!r} for snapguard-runc's launcher")
    for path in (config_path, runc, entry):
        if not os.path.isabs(path):
            raise ValueError(f"cannot pin {path!r} for snapguard-runc's launcher: not an absolute path")
    text = f"{LAUNCHER_PIN_HEADER}\nconfig {config_path}\nstamp {stamp}\nrunc {runc}\nentry {entry}\n"
    return text.encode("utf-8", "surrogateescape")


def read_launcher_pin(path: str) -> tuple[bytes, dict[str, str]] | None:
    """The pinned file's bytes and fields, where root alone controls it and it is well formed;
    None otherwise (missing: the launcher is not installed for this config)."""
    try:
        fd = open_trusted(path, "file")
    except UntrustedPathError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(8192)
    except OSError:
        return None
    lines = raw.decode("utf-8", "surrogateescape").split("\n")
    if len(raw) >= 8192 or not lines or lines[0] != LAUNCHER_PIN_HEADER or lines[-1] != "":
        return None
    fields = dict(line.partition(" ")[::2] for line in lines[1:-1])
    if not {"config", "stamp", "runc", "entry"} <= set(fields):
        return None
    return raw, fields


def sync_launcher_pin(config_path: str, st: os.stat_result, runc: str) -> None:
    """Where the launcher's pinned file beside `config_path` exists (it was installed) and no
    longer says that this config file, as `st` identifies it, gives `runc`: rewrite it, whole
    (a temporary file renamed over it). Nothing is raised: a pinned file that cannot be written
    only sends the launcher's calls to the Python entry, which reads the config itself."""
    path = launcher_pin_path(config_path)
    found = read_launcher_pin(path)
    if found is None or found[1]["config"] != config_path:
        return
    try:
        text = render_launcher_pin(config_path, pin_stamp(st), runc, found[1]["entry"])
    except ValueError:
        return
    if text != found[0]:
        write_pin_file(path, text)


def write_pin_file(path: str, text: bytes) -> bool:
    """Write the pinned file whole, root's (where run as root), 0644; False where it could not."""
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".{LAUNCHER_PIN_NAME}.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError:
        return False
    try:
        try:
            os.fchmod(fd, 0o644)
            if os.geteuid() == 0:
                os.fchown(fd, 0, 0)
            os.write(fd, text)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
