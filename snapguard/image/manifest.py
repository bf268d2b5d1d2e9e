"""The compatibility manifest: its JSON Schema check, the `Manifest` type read from it, and the
comparison of an image's host with this one.

A manifest may come from another host: nothing reads it before `validate_manifest` checked it
against manifest.schema.json. `Manifest.from_json` builds the typed record only from a manifest
that passed; `to_json()` gives back exactly the JSON it was built from (the on-disk format, which
stores and other hosts read, is that JSON, unknown top-level fields included).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from ..reasons import Finding, Reason, Severity, SnapguardError
from ._io import MAX_DETAIL

__all__ = ["SCHEMA", "FileEntry", "ImageHost", "Manifest", "ProcessEntry", "compare_with_host",
           "validate_manifest"]

SCHEMA = "snapguard.manifest/1"
SCHEMA_FILE = "manifest.schema.json"  # in this package: the JSON Schema of a SCHEMA manifest

_validator_cache: Any = None


def invalid(detail: str, image_dir: str) -> SnapguardError:
    return SnapguardError(Reason.MANIFEST_INVALID, detail, evidence={"image": image_dir})


def _validator() -> Any:
    """The manifest schema's validator, compiled once. jsonschema is imported here, not at module
    level: the executor's pass-through path imports this package and must stay fast."""
    global _validator_cache
    if _validator_cache is None:
        from importlib import resources

        import jsonschema
        from jsonschema import validators

        schema = json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text("utf-8"))
        base = jsonschema.Draft202012Validator
        base.check_schema(schema)
        # JSON Schema counts 1.0 as an integer; a pid or a size read from a manifest must be an int.
        strict = base.TYPE_CHECKER.redefine("integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))
        _validator_cache = validators.extend(base, type_checker=strict)(schema)
    return _validator_cache


def _json_path(parts: Any) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier():
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out if len(out) <= 120 else out[:120] + "..."


def validate_manifest(manifest: Any, image_dir: str) -> dict[str, Any]:
    """Check a manifest that may come from another host against the schema; return it.

    The first (most relevant) violation becomes one MANIFEST_INVALID line naming the field."""
    from jsonschema.exceptions import best_match

    error = best_match(_validator().iter_errors(manifest))
    if error is None:
        return manifest  # type: ignore[no-any-return]
    message = error.message
    if error.validator == "const":
        message = f"{error.instance!r} is not {error.validator_value!r}"
    elif error.validator == "not":
        message = f"{error.instance!r} is not allowed"
    shown = repr(error.instance)
    if len(shown) > 80:  # the messages quote the bad value whole: keep its start only
        message = message.replace(shown, shown[:80] + "...")
    message = " ".join(message.split())
    if len(message) > MAX_DETAIL:
        message = message[:MAX_DETAIL] + "..."
    where = _json_path(error.absolute_path)
    raise invalid(f"manifest field {where}: {message}" if where else f"manifest: {message}", image_dir)


@dataclass(frozen=True)
class FileEntry:
    """One image file as sealed: its size and digest (hashing.hash_all's scheme)."""

    size: int
    sha256: str


@dataclass(frozen=True)
class ProcessEntry:
    """One process of the dumped tree. `nspid`: its pid in its own namespace (the host pid when
    the manifest does not say)."""

    pid: int
    nspid: int
    comm: str
    gpu: bool
    gpu_memory_bytes: int
    rss_bytes: int


@dataclass(frozen=True)
class ImageHost:
    """The host the image was taken on."""

    kernel: str
    arch: str
    hostname: str
    cpu_model: str
    cpu_flags: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    """A validated manifest. Built only by `from_json` (the schema first); `to_json()` is the JSON."""

    schema: str
    snapguard_version: str
    epoch: float
    criu_version: str
    image_bytes: int
    host: ImageHost
    processes: tuple[ProcessEntry, ...]
    files: dict[str, FileEntry]
    take_point: dict[str, Any]  # {str(pid): the take point's figures for it}, as the take point gave them
    gpu: dict[str, Any] | None  # driver versions and the image node's GPUs (preflight.gpu.image_gpu_facts)
    network_lock: str | None
    own_netns: bool | None
    tcp_connections: int | None
    leave_running: bool | None
    root_pid: int | None
    container_id: str | None
    bare: bool | None
    fence_epoch: int | None
    _json: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Any, image_dir: str) -> Manifest:
        """The manifest `data` (parsed JSON), validated (MANIFEST_INVALID) and typed."""
        m = validate_manifest(data, image_dir)
        host = m["host"]
        return cls(
            schema=m["schema"], snapguard_version=m["snapguard_version"], epoch=m["epoch"],
            criu_version=m["criu_version"], image_bytes=m["image_bytes"],
            host=ImageHost(host["kernel"], host["arch"], host["hostname"], host["cpu"]["model"],
                           tuple(host["cpu"]["flags"])),
            processes=tuple(ProcessEntry(p["pid"], p.get("nspid", p["pid"]), p["comm"], p["gpu"],
                                         p["gpu_memory_bytes"], p["rss_bytes"]) for p in m["processes"]),
            files={name: FileEntry(e["size"], e["sha256"]) for name, e in m["files"].items()},
            take_point=m.get("take_point") or {}, gpu=m.get("gpu"), network_lock=m.get("network_lock"),
            own_netns=m.get("own_netns"), tcp_connections=m.get("tcp_connections"),
            leave_running=m.get("leave_running"), root_pid=m.get("root_pid"), container_id=m.get("container_id"),
            bare=m.get("bare"), fence_epoch=m.get("fence_epoch"), _json=m)

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON, exactly as read (a copy)."""
        return copy.deepcopy(self._json)

    @property
    def gpus(self) -> list[dict[str, Any]]:
        """The image node's GPUs (none without a GPU section)."""
        return list((self.gpu or {}).get("gpus") or [])

    @property
    def uses_gpu(self) -> bool:
        return any(p.gpu for p in self.processes)

    @property
    def needs_network_lock(self) -> bool:
        """A tree dumped in the host's network namespace needs a lock only for its TCP connections."""
        return self.own_netns is not False or (bool(self.tcp_connections) and self.network_lock != "skip")

    @property
    def held(self) -> bool:
        """Every process of the image the take point knew was held at a step boundary when it was
        dumped: restored, it waits there until released."""
        points = self.take_point
        return bool(points) and all(isinstance(f, dict) and f.get("ok") for f in points.values())

    def file_names_up_to(self, max_bytes: int) -> list[str]:
        return [name for name, entry in self.files.items() if entry.size <= max_bytes]


def compare_with_host(manifest: Manifest, host: dict[str, Any], criu_version: str) -> list[Finding]:
    """What stops this image from running here (blockers) and what differs (warnings). `host`:
    procfs.host_facts() of this host, with `mem_available`."""
    findings = []
    src = manifest.host
    if src.arch != host["arch"]:
        findings.append(Finding(Reason.CPU_FEATURE_MISMATCH,
                                f"image taken on {src.arch}, this host is {host['arch']}",
                                evidence={"image_arch": src.arch, "host_arch": host["arch"]}))
    missing = sorted(set(src.cpu_flags) - set(host["cpu"]["flags"]))
    if missing:
        findings.append(Finding(Reason.CPU_FEATURE_MISMATCH,
                                f"this host's CPU lacks {len(missing)} flag(s) the image's CPU had: "
                                f"{' '.join(missing[:12])}",
                                evidence={"missing_flags": missing, "image_cpu": src.cpu_model,
                                          "host_cpu": host["cpu"]["model"]}))
    if src.kernel != host["kernel"]:
        findings.append(Finding(Reason.KERNEL_CHANGED,
                                f"image taken under kernel {src.kernel}, this host runs {host['kernel']}",
                                Severity.WARNING, {"image_kernel": src.kernel, "host_kernel": host["kernel"]}))
    available = host.get("mem_available")
    if isinstance(available, int) and manifest.image_bytes > available:
        findings.append(Finding(Reason.HOST_MEMORY_INSUFFICIENT,
                                f"the image holds {manifest.image_bytes >> 20} MiB of process and GPU memory, "
                                f"this host has {available >> 20} MiB available",
                                evidence={"needed": manifest.image_bytes, "available": available}))
    if manifest.criu_version != criu_version:
        findings.append(Finding(Reason.CRIU_VERSION_CHANGED,
                                f"image written by CRIU {manifest.criu_version}, this host has {criu_version}",
                                Severity.WARNING,
                                {"image_criu": manifest.criu_version, "host_criu": criu_version}))
    return findings
