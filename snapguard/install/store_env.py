"""containerd's environment for the pod fence: SNAPGUARD_STORE, through a systemd drop-in.

A pod restored with `snapguard.io/epoch` takes the job's next epoch in the image store that
SNAPGUARD_STORE names in containerd's environment (snapguard.pipeline.pod_fence reads it there,
never from the pod); without it such a pod is refused. With `--store URL`, install writes
`<systemd dir>/<name>-store.conf` (default dir /etc/systemd/system/containerd.service.d):

    [Service]
    Environment="SNAPGUARD_STORE=s3://snaps/train"

recorded like every file it writes (a second run changes nothing, --uninstall removes it); systemd
reads it after `systemctl daemon-reload`. Without --store, a drop-in an earlier run wrote is kept,
and where there is none the plan's `next` steps say that containerd needs the variable.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from .. import __version__
from ..pipeline import STORE_ENV
from .base import DEFAULT_SYSTEMD_DIR, absent_dirs, fail, read_trusted, sha
from .changes import Change, Plan

__all__ = ["DEFAULT_SYSTEMD_DIR", "KIND", "check_store_url", "plan_store_env", "unit_dropin"]

KIND = "systemd-dropin"  # its record's kind in the install state


def check_store_url(url: str) -> str:
    """The store URL as a unit file can carry it: file:///absolute/dir or s3://bucket[/prefix],
    printable ASCII without spaces, quotes or backslashes; USAGE_ERROR otherwise."""
    bad = [c for c in url if not 0x21 <= ord(c) <= 0x7e or c in "\"'\\"]
    if bad:
        raise fail(f"--store {url!r}: a store URL in containerd's unit is printable ASCII without spaces, quotes or "
                   f"backslashes (found {bad[0]!r}; percent-encode it)")
    parts = urlsplit(url)
    if parts.scheme == "file" and parts.netloc in ("", "localhost") and parts.path.startswith("/"):
        return url
    if parts.scheme == "s3" and parts.netloc:
        return url
    raise fail(f"--store {url}: the image store is file:///absolute/dir or s3://bucket[/prefix]")


def unit_dropin(url: str) -> bytes:
    """The drop-in's bytes: `%` doubled, systemd's specifier escape."""
    return (f"# Written by `snapguard install` (snapguard {__version__}); `snapguard install --uninstall` removes\n"
            f"# it. The image store a pod's restore fences its epoch in (snapguard.io/epoch): containerd's\n"
            f"# environment, which its runc shim and snapguard-runc inherit. Load it: systemctl daemon-reload.\n"
            f"[Service]\nEnvironment=\"{STORE_ENV}={url.replace('%', '%%')}\"\n").encode()


def plan_store_env(store: str | None, systemd_dir: str, name: str, records: dict[str, Any], plan: Plan) -> None:
    """The drop-in's Change (with --store), the store in the plan's facts, and its next steps."""
    if not os.path.isabs(systemd_dir):
        raise fail(f"--systemd-dir must be an absolute path, got {systemd_dir!r}")
    path = os.path.join(os.path.normpath(systemd_dir), f"{name}-store.conf")
    before = read_trusted(path, "containerd's systemd drop-in")
    rec = records.get(path)
    if store is None:
        kept = rec is not None and before is not None and sha(before) == rec.get("sha256")
        plan.facts["store"] = {"url": None, "dropin": path if kept else None}
        if kept:
            plan.changes.append(Change(path, "unchanged", before, before, summary=f"{STORE_ENV} for containerd"))
        else:
            records.pop(path, None)
            plan.next.append(f"give containerd {STORE_ENV}=<store URL> in its environment (`snapguard install "
                             f"--store URL` writes a systemd drop-in for it): without it a pod restored under "
                             "snapguard.io/epoch is refused")
        return
    url = check_store_url(store)
    text = unit_dropin(url)
    if before is not None and before != text and (rec is None or rec.get("sha256") != sha(before)):
        raise fail(f"{path} exists and was not written by snapguard install (or was changed since): move it away "
                   "and run again")
    dirs = [d for d in absent_dirs(os.path.dirname(path)) if d not in plan.dirs]
    plan.dirs += dirs
    action = "unchanged" if before == text else "replace" if before is not None else "create"
    plan.changes.append(Change(path, action, before, text, summary=f"{STORE_ENV}={url} for containerd"))
    records[path] = {"kind": KIND, "sha256": sha(text), "created_dirs": (rec or {}).get("created_dirs") or dirs}
    plan.facts["store"] = {"url": url, "dropin": path}
    if action != "unchanged":
        plan.next.append("systemctl daemon-reload  (systemd reads containerd's new drop-in)")
    if url.startswith("s3://"):
        plan.next.append("give containerd the store's credentials and endpoint too (AWS_* or an instance role, "
                         "S3_ENDPOINT_URL), in its environment or a drop-in of your own")
