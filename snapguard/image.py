"""The compatibility manifest and the integrity of an image directory.

At checkpoint: every file of the image is hashed into the manifest (sha256 over the sha256s of its
64 MiB spans, so that large page files hash on every core), the manifest is written 0600,
and a completion marker holding the manifest's sha256 is written last. At restore: no marker means
a half-written or half-copied image; a changed file or manifest means corruption; and the manifest,
which may come from another host, is validated field by field before anything reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Any

from . import __version__
from .files import write_private_bytes, write_private_json
from .reasons import Finding, Reason, Severity, SnapguardError

__all__ = ["MANIFEST_NAME", "MARKER_NAME", "SCHEMA", "compare_with_host", "seal", "verify"]

SCHEMA = "snapguard.manifest/1"
MANIFEST_NAME = "snapguard-manifest.json"
MARKER_NAME = "snapguard-complete.json"
# Files that are not part of what was dumped: snapguard's own, and what a restore adds.
_NOT_IMAGE = frozenset({MANIFEST_NAME, MARKER_NAME, "snapguard-result.json", "restore.log"})
_MAX_FILES = 100_000
_MAX_MANIFEST_BYTES = 64 << 20
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_READ = 4 << 20
_SPAN = 64 << 20  # files are hashed in spans of this size (the manifest's digest scheme)
_PARALLEL_BYTES = 256 << 20


def _sha256_span(path: str, offset: int, length: int) -> bytes:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        done = 0
        while done < length:
            block = os.pread(fd, min(_READ, length - done), offset + done)
            if not block:
                break  # the file shrank: its digest will not match
            h.update(block)
            done += len(block)
    finally:
        os.close(fd)
    return h.digest()


def _spans(path: str) -> tuple[int, list[tuple[str, int, int]]]:
    size = os.lstat(path).st_size
    return size, [(path, off, min(_SPAN, size - off)) for off in range(0, size, _SPAN)] or [(path, 0, 0)]


def _image_files(image_dir: str) -> list[str]:
    names = []
    for root, dirs, files in os.walk(image_dir):
        rel_root = os.path.relpath(root, image_dir)
        dirs.sort()
        for name in sorted(files):
            rel = name if rel_root == "." else f"{rel_root}/{name}"
            if rel in _NOT_IMAGE or ".tmp." in name:
                continue
            names.append(rel)
    return names


def _hash_all(image_dir: str, names: list[str]) -> dict[str, tuple[int, str]]:
    """{name: (size, digest)}: the digest is the sha256 of the sha256s of the file's 64 MiB spans,
    so that one 6 GB pages file is hashed by all cores, not one."""
    sized = {n: _spans(os.path.join(image_dir, n)) for n in names}
    spans = [span for _, file_spans in sized.values() for span in file_spans]
    if sum(size for size, _ in sized.values()) < _PARALLEL_BYTES or (os.cpu_count() or 1) == 1:
        digests = [_sha256_span(*span) for span in spans]
    else:
        # hashlib releases the GIL on large buffers. Imported here: small images should not pay
        # for the import on every checkpoint.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            digests = list(pool.map(lambda span: _sha256_span(*span), spans))
    out, i = {}, 0
    for name, (size, file_spans) in sized.items():
        out[name] = (size, hashlib.sha256(b"".join(digests[i:i + len(file_spans)])).hexdigest())
        i += len(file_spans)
    return out


def seal(image_dir: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Tighten the image to root alone, hash it, write the manifest, then the completion marker."""
    names = _image_files(image_dir)
    for name in names:
        # CRIU writes its images 0644; they hold process memory.
        os.chmod(os.path.join(image_dir, name), 0o600)
    hashed = _hash_all(image_dir, names)
    manifest = {
        "schema": SCHEMA,
        "snapguard_version": __version__,
        "epoch": time.time(),
        **fields,
        "files": {name: {"size": size, "sha256": digest} for name, (size, digest) in hashed.items()},
        "image_bytes": sum(size for size, _ in hashed.values()),
    }
    data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    write_private_bytes(os.path.join(image_dir, MANIFEST_NAME), data)
    write_private_json(os.path.join(image_dir, MARKER_NAME),
                       {"manifest_sha256": hashlib.sha256(data).hexdigest(), "schema": SCHEMA})
    return manifest


def _invalid(detail: str, image_dir: str) -> SnapguardError:
    return SnapguardError(Reason.MANIFEST_INVALID, detail, evidence={"image": image_dir})


def _require(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], image_dir: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise _invalid(f"manifest field `{key}` is missing or not {getattr(kind, '__name__', kind)}", image_dir)
    return value


def _valid_name(name: str) -> bool:
    parts = name.split("/")
    return (bool(name) and len(name) <= 4096 and "\0" not in name and not name.startswith("/")
            and all(p not in ("", ".", "..") for p in parts))


def _validate_gpu(gpu: Any, image_dir: str) -> None:
    if not isinstance(gpu, dict):
        raise _invalid("manifest field `gpu` is not an object", image_dir)
    _require(gpu, "driver_version", str, image_dir)
    gpus = _require(gpu, "gpus", list, image_dir)
    for g in gpus:
        if not isinstance(g, dict):
            raise _invalid("manifest GPU entry is not an object", image_dir)
        for key in ("name", "uuid"):
            _require(g, key, str, image_dir)
        for key in ("index", "memory_total", "used_by_image"):
            if _require(g, key, int, image_dir) < 0:
                raise _invalid(f"manifest GPU field `{key}` is negative", image_dir)


def validate_manifest(manifest: Any, image_dir: str) -> dict[str, Any]:
    """Check the shape of a manifest that may come from another host; return it."""
    if not isinstance(manifest, dict):
        raise _invalid("manifest is not a JSON object", image_dir)
    if manifest.get("schema") != SCHEMA:
        raise _invalid(f"manifest schema is {manifest.get('schema')!r}, expected {SCHEMA!r}", image_dir)
    _require(manifest, "snapguard_version", str, image_dir)
    _require(manifest, "epoch", (int, float), image_dir)
    _require(manifest, "criu_version", str, image_dir)
    _require(manifest, "image_bytes", int, image_dir)
    host = _require(manifest, "host", dict, image_dir)
    for key in ("kernel", "arch", "hostname"):
        _require(host, key, str, image_dir)
    cpu = _require(host, "cpu", dict, image_dir)
    _require(cpu, "model", str, image_dir)
    flags = _require(cpu, "flags", list, image_dir)
    if not all(isinstance(f, str) and f.isprintable() and len(f) < 64 for f in flags):
        raise _invalid("manifest CPU flags are not short strings", image_dir)
    if manifest.get("network_lock") not in (None, "skip"):
        raise _invalid("manifest field `network_lock` must be null or \"skip\"", image_dir)
    if not isinstance(manifest.get("own_netns", False), bool):
        raise _invalid("manifest field `own_netns` is not a boolean", image_dir)
    if manifest.get("gpu") is not None:
        _validate_gpu(manifest["gpu"], image_dir)
    files = _require(manifest, "files", dict, image_dir)
    if len(files) > _MAX_FILES:
        raise _invalid(f"manifest lists {len(files)} files, more than {_MAX_FILES}", image_dir)
    for name, entry in files.items():
        if not _valid_name(name):
            raise _invalid(f"manifest file name {name!r} is not a plain relative path", image_dir)
        if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or entry["size"] < 0
                or not isinstance(entry.get("sha256"), str) or not _HEX64.match(entry["sha256"])):
            raise _invalid(f"manifest entry for {name!r} needs a size and a sha256", image_dir)
    return manifest


def verify(image_dir: str) -> dict[str, Any]:
    """Refuse an incomplete, corrupt or invalid image; return its validated manifest."""
    marker_path = os.path.join(image_dir, MARKER_NAME)
    manifest_path = os.path.join(image_dir, MANIFEST_NAME)
    if not os.path.isdir(image_dir):
        raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"image directory {image_dir} does not exist",
                             evidence={"image": image_dir})
    try:
        with open(marker_path, "rb") as f:
            marker = json.loads(f.read(4096))
        expected = marker["manifest_sha256"]
    except FileNotFoundError:
        raise SnapguardError(Reason.IMAGE_INCOMPLETE,
                             f"{image_dir} has no {MARKER_NAME}: the image was not completed or not fully copied",
                             evidence={"image": image_dir}) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SnapguardError(Reason.IMAGE_CORRUPT, f"completion marker {marker_path} is unreadable: {e}",
                             evidence={"image": image_dir}) from None
    try:
        with open(manifest_path, "rb") as f:
            data = f.read(_MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise _invalid(f"cannot read {manifest_path}: {e.strerror}", image_dir) from None
    if hashlib.sha256(data).hexdigest() != expected:
        raise SnapguardError(Reason.IMAGE_CORRUPT, f"{MANIFEST_NAME} does not match the completion marker",
                             evidence={"image": image_dir, "path": manifest_path})
    try:
        manifest = validate_manifest(json.loads(data), image_dir)
    except ValueError as e:
        raise _invalid(f"{manifest_path} is not JSON: {e}", image_dir) from None
    files: dict[str, dict[str, Any]] = manifest["files"]
    for name, entry in files.items():
        path = os.path.join(image_dir, name)
        try:
            st = os.lstat(path)
        except OSError:
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {name} is missing",
                                 evidence={"image": image_dir, "path": path}) from None
        if not os.path.isfile(path) or os.path.islink(path) or st.st_size != entry["size"]:
            raise SnapguardError(Reason.IMAGE_CORRUPT,
                                 f"image file {name} has size {st.st_size}, manifest says {entry['size']}",
                                 evidence={"image": image_dir, "path": path})
    for name, (_, digest) in _hash_all(image_dir, list(files)).items():
        if digest != files[name]["sha256"]:
            raise SnapguardError(Reason.IMAGE_CORRUPT,
                                 f"image file {name} has sha256 {digest[:16]}..., manifest says "
                                 f"{files[name]['sha256'][:16]}...",
                                 evidence={"image": image_dir, "path": os.path.join(image_dir, name),
                                           "expected": files[name]["sha256"], "actual": digest})
    return manifest


def compare_with_host(manifest: dict[str, Any], host: dict[str, Any], criu_version: str) -> list[Finding]:
    """What stops this image from running here (blockers) and what differs (warnings)."""
    findings = []
    src = manifest["host"]
    if src["arch"] != host["arch"]:
        findings.append(Finding(Reason.CPU_FEATURE_MISMATCH,
                                f"image taken on {src['arch']}, this host is {host['arch']}",
                                evidence={"image_arch": src["arch"], "host_arch": host["arch"]}))
    missing = sorted(set(src["cpu"]["flags"]) - set(host["cpu"]["flags"]))
    if missing:
        findings.append(Finding(Reason.CPU_FEATURE_MISMATCH,
                                f"this host's CPU lacks {len(missing)} flag(s) the image's CPU had: "
                                f"{' '.join(missing[:12])}",
                                evidence={"missing_flags": missing, "image_cpu": src["cpu"]["model"],
                                          "host_cpu": host["cpu"]["model"]}))
    if src["kernel"] != host["kernel"]:
        findings.append(Finding(Reason.KERNEL_CHANGED,
                                f"image taken under kernel {src['kernel']}, this host runs {host['kernel']}",
                                Severity.WARNING, {"image_kernel": src["kernel"], "host_kernel": host["kernel"]}))
    available = host.get("mem_available")
    if isinstance(available, int) and manifest["image_bytes"] > available:
        findings.append(Finding(Reason.HOST_MEMORY_INSUFFICIENT,
                                f"the image holds {manifest['image_bytes'] >> 20} MiB of process and GPU memory, "
                                f"this host has {available >> 20} MiB available",
                                evidence={"needed": manifest["image_bytes"], "available": available}))
    if manifest["criu_version"] != criu_version:
        findings.append(Finding(Reason.CRIU_VERSION_CHANGED,
                                f"image written by CRIU {manifest['criu_version']}, this host has {criu_version}",
                                Severity.WARNING,
                                {"image_criu": manifest["criu_version"], "host_criu": criu_version}))
    return findings
