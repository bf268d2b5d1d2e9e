"""The table of snapguard's configuration keys: the one description of each.

Each key has its name, its kind (an absolute path, an integer in a range, or an on/off switch), its
default, the environment variable that overrides it, a short comment (the line `snapguard install`
writes beside the value, and the Debian template's) and a paragraph for the config reference.

The loader (snapguard.config) validates and overrides by this table; `snapguard install` writes
its comments from it; the Debian package's template (packaging/debian/config.toml) and the
Markdown reference are rendered from it:

    python -m snapguard.config template > packaging/debian/config.toml
    python -m snapguard.config markdown

This module imports nothing: it is read on the executor's pass-through path.
"""

from __future__ import annotations

__all__ = ["CONFIG_ENV", "KEYS", "Key", "SWITCH_WORDS", "by_name", "render_markdown", "render_template"]

# The environment variable naming the config file (default /etc/snapguard/config.toml).
CONFIG_ENV = "SNAPGUARD_CONFIG"
DEFAULT_CONFIG_PATH = "/etc/snapguard/config.toml"

# The words a switch's environment variable takes, each way.
SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                "off": False}


class Key:
    """One configuration key. `kind` is "path" (an absolute path; its environment variable is read
    on every call), "int" (from 1 to `high`), "switch" (true or false; its environment variable,
    a word of SWITCH_WORDS, is read only by a full load: checkpoint and restore) or "text" (a
    string the command that uses it checks: the agent's; its environment variable is read by a
    full load)."""

    __slots__ = ("name", "kind", "default", "env", "comment", "description", "high")

    def __init__(self, name: str, kind: str, default: object, env: str | None, comment: str, description: str,
                 high: int | None = None) -> None:
        self.name = name
        self.kind = kind
        self.default = default
        self.env = env
        self.comment = comment
        self.description = " ".join(description.split())
        self.high = high

    @property
    def type_name(self) -> str:
        return {"path": "absolute path", "int": f"integer, 1 to {self.high}", "switch": "boolean",
                "text": "string"}[self.kind]

    def __repr__(self) -> str:
        return f"Key({self.name!r}, {self.kind!r}, {self.default!r})"


KEYS: tuple[Key, ...] = (
    Key("runc", "path", "/usr/sbin/runc", "SNAPGUARD_RUNC",
        "the real runc (or NVIDIA's runtime in front of it) every non-snapshot verb goes to",
        """The real runc that snapguard-runc hands every verb but checkpoint and restore to, and
        that runs those two under CRIU. `snapguard install` points it at NVIDIA's
        `nvidia-container-runtime` where that is containerd's default runtime, so GPU containers
        keep their devices."""),
    Key("criu", "path", "/usr/local/sbin/criu", "SNAPGUARD_CRIU", "CRIU >= 4.0",
        """CRIU, 4.0 or newer, run as root for every checkpoint and restore."""),
    Key("criu_libdir", "path", "/usr/local/lib/criu", "SNAPGUARD_CRIU_LIBDIR",
        "CRIU's plugin directory (cuda_plugin.so); every .so in it is loaded as root",
        """CRIU's plugin directory, where it finds `cuda_plugin.so`. CRIU loads every `.so` in it as
        root, so the directory and each plugin in it must be root's alone."""),
    Key("cuda_checkpoint", "path", "/usr/local/bin/cuda-checkpoint", "SNAPGUARD_CUDA_CHECKPOINT",
        "NVIDIA's cuda-checkpoint; where missing, snapguard-cuda-checkpoint is used",
        """NVIDIA's cuda-checkpoint, which CRIU's CUDA plugin runs to suspend and resume each CUDA
        process. Where it is missing, snapguard's own snapguard-cuda-checkpoint (installed beside
        snapguard) is used."""),
    Key("state_dir", "path", "/run/snapguard", "SNAPGUARD_STATE_DIR",
        "root-only: run directories, the runc path cache",
        """snapguard's root-only working directory: run directories, the agent's state, the runc
        path cache. Created 0700 where missing; the part that exists must be root's alone."""),
    Key("criu_timeout_s", "int", 60, None, "CRIU's own timeout, seconds",
        """CRIU's own timeout, in seconds; the whole runc or CRIU run gets ten times it, at most
        `run_timeout_s`.""", high=3600),
    Key("run_timeout_s", "int", 36000, None, "the longest a whole runc or CRIU run may take, seconds",
        """The most snapguard's deadline on a whole runc or CRIU run may be, in seconds: the run
        gets ten times `criu_timeout_s`, or this where it is less. When the deadline passes, the
        run's process group is killed: CRIU_TIMEOUT or RUNC_TIMEOUT, the workload brought back. A
        dump whose workload died under it is ended a tenth of the deadline (at most 10 s) after.""",
        high=36000),
    Key("take_wait_s", "int", 10, None, "how long a snapshot waits for the workload's take point, seconds",
        """How long a snapshot waits for the workload's take point (its step boundary), in seconds;
        then it goes on without it, with a TAKE_POINT_TIMEOUT warning. `snapguard checkpoint
        --take-wait` overrides it.""", high=600),
    Key("cuda_broker", "switch", True, "SNAPGUARD_CUDA_BROKER_ON",
        "the executor answers CRIU's CUDA plugin itself while CRIU runs (shorter stall and restore)",
        """While CRIU runs, the executor answers its CUDA plugin's cuda-checkpoint runs itself
        (snapguard.cuda.Broker): a shorter stall and restore. False runs the tool each time."""),
    Key("hash_while_dumping", "switch", True, "SNAPGUARD_HASH_WHILE_DUMPING_ON",
        "the image's page files are hashed while CRIU writes them (a shorter seal)",
        """A stop snapshot's page files are hashed while CRIU writes them, so the seal after the
        dump hashes only the rest."""),
    Key("restore_prefetch", "switch", True, "SNAPGUARD_RESTORE_PREFETCH_ON",
        "a restore has CRIU's files read ahead of the image's digest check (a cold restore)",
        """A restore asks the kernel to read CRIU, its libraries and plugins, cuda-checkpoint and
        the image's small files before the digest check's large reads begin, so that CRIU's start
        does not queue behind them on a cold page cache."""),
    Key("cri_socket", "text", "", "SNAPGUARD_CRI_SOCKET",
        "the agent's CRI path: containerd's CRI socket (empty: off); needs `registry`",
        """The agent's CRI path (the kubelet's): containerd's CRI socket, an absolute path such as
        `/run/containerd/containerd.sock`, on which `snapguard agent` lists the node's opted-in
        pods and takes each one's stopping snapshot through CRI CheckpointContainer. Empty: off.
        Needs `registry` and the agent's `--store`. `snapguard agent --cri-socket` overrides it."""),
    Key("registry", "text", "", "SNAPGUARD_REGISTRY",
        "the registry the CRI path pushes checkpoint images to, http(s)://HOST[:PORT]",
        """The OCI registry the agent's CRI path pushes each checkpoint image to,
        `http://` or `https://HOST[:PORT]` with no path. `snapguard agent --registry` overrides
        it."""),
    Key("registry_repository", "text", "snapguard/ckpt", "SNAPGUARD_REGISTRY_REPOSITORY",
        "the checkpoint images' repository prefix: PREFIX/JOB",
        """The repository prefix of the CRI path's checkpoint images, which go to PREFIX/JOB
        (lower-case letters, digits, `.`, `_`, `-`, `/`). `snapguard agent --registry-repository`
        overrides it."""),
)

_BY_NAME = {key.name: key for key in KEYS}


def by_name(name: str) -> Key:
    """The key called `name` (KeyError where there is none)."""
    return _BY_NAME[name]


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


TEMPLATE_HEADER = """\
# /etc/snapguard/config.toml: the pinned absolute paths snapguard runs as root, and its settings.
# `snapguard install` fills this in with what it finds on the node (and points `runc` at NVIDIA's
# runtime where that is containerd's default); `snapguard install --uninstall` puts this file back.
# Unset keys take the defaults below. Each binary must be a root-owned file writable by root
# alone, on a path only root can change; nothing is looked up in PATH.
# Generated from snapguard/config/keys.py: python -m snapguard.config template
#
"""


def render_template() -> str:
    """The Debian package's /etc/snapguard/config.toml: every key commented out at its default."""
    lines = []
    for key in KEYS:
        lines += [f"# {key.comment}", f"# {key.name} = {_toml(key.default)}", "#"]
    return TEMPLATE_HEADER + "\n".join(lines[:-1]) + "\n"


def render_markdown() -> str:
    """The config reference: one table row per key, then each key's paragraph."""
    out = ["| Key | Type | Default | Environment |", "| --- | --- | --- | --- |"]
    for key in KEYS:
        env = f"`{key.env}`" if key.env else "-"
        out.append(f"| `{key.name}` | {key.type_name} | `{_toml(key.default)}` | {env} |")
    out += ["", f"The file is `{DEFAULT_CONFIG_PATH}`, or the one `{CONFIG_ENV}` names. Environment "
            "variables override the file, and a command's flags override both; a switch's variable takes "
            f"one of {', '.join(w for w in SWITCH_WORDS)} and, like a string's, is read only by a full load "
            "(checkpoint, restore, the agent).", ""]
    for key in KEYS:
        out += [f"## `{key.name}`", "", key.description, ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """`python -m snapguard.config template|markdown`."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args not in (["template"], ["markdown"]):
        print("usage: python -m snapguard.config template|markdown", file=sys.stderr)
        return 2
    sys.stdout.write(render_template() if args == ["template"] else render_markdown())
    return 0

