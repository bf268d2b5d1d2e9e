"""`snapguard-runc --help`, `snapguard-runc checkpoint --help`, `snapguard-runc restore --help`:
snapguard's own part first (what the executor adds, its own flags), then the real runc's help
for the same command, asked of the pinned runc under a deadline."""

from __future__ import annotations

__all__ = ["HELP", "RUNC_HELP_TIMEOUT_S", "asks_help", "help_text"]

RUNC_HELP_TIMEOUT_S = 5.0

_RESTORE_FLAGS = """\
snapguard's own restore flags (right after `restore`, before runc's; runc never sees them):
   --store URL    restore from an image store (file:///dir or s3://bucket/prefix): the job's
                  newest whole image is fetched into --image-path (new or empty), verified as it
                  is written, and the job's next fencing epoch is taken right before runc restores
   --job J        with --store: the job (default: the store's only job)
   --image NAME   with --store: this image instead of the newest whole one
   (--from, --from-job, --from-image: the old spellings, deprecated)
"""

HELP = {
    None: """\
snapguard-runc: the guarded runc executor. containerd runs it in place of runc; every command but
checkpoint and restore is handed to the pinned real runc unchanged. checkpoint and restore run
snapguard's guards around runc's: preflight (CRIU, the CUDA plugin, the workload's processes),
the take point (a trainer stops at a step boundary), checksummed images with a completion
marker, and every CUDA process brought back to running on failure. Failures are one typed line
(`snapguard REASON: ...`) in runc's --log; `snapguard reasons NAME` explains one. Configuration:
/etc/snapguard/config.toml ($SNAPGUARD_CONFIG). See `snapguard-runc restore --help`.
""",
    "checkpoint": """\
snapguard-runc checkpoint: runc's checkpoint with snapguard's guards (preflight, the take point,
CRIU with its CUDA plugin, a sealed image with checksums and a completion marker; on failure every
CUDA process is brought back to running). No flags of its own: runc's, below.
""",
    "restore": """\
snapguard-runc restore: runc's restore of a sealed image, verified first (completion marker,
checksums, manifest) and compared with this host (CPU, driver, GPU model, count and memory).
""" + _RESTORE_FLAGS,
}

_HELP_TOKENS = frozenset(("-h", "--h", "-help", "--help", "-h=true", "--h=true", "-help=true", "--help=true"))


def asks_help(tokens: list[str]) -> bool:
    """A help flag among a command's tokens before `--` (Go's flag package: -h, --help, =true)."""
    for token in tokens:
        if token == "--":
            return False
        if token in _HELP_TOKENS:
            return True
    return False


def help_text(verb: str | None) -> str:
    """snapguard's part for the verb, then what the pinned runc prints for `[verb] --help`."""
    from .. import children
    from ..config import ConfigError, pinned_runc

    ours = HELP[verb]
    try:
        runc = pinned_runc()
    except ConfigError as e:
        return f"{ours}\n(runc's own help cannot be shown: {e})\n"
    answer = children.probe([runc, *([verb] if verb else []), "--help"], RUNC_HELP_TIMEOUT_S)
    if isinstance(answer, str):
        return f"{ours}\n(runc's own help cannot be shown: {answer})\n"
    return f"{ours}\nrunc's own {'flags' if verb else 'help'} ({runc}):\n\n{answer.stdout or answer.stderr}"
