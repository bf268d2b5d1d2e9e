"""`snapguard inspect DIR|URL`: one image, as kubectl describe shows one object: where and when it
was taken, its processes, GPUs, take point figures, sizes, and the checks against this host."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from ..reasons import Reason, SnapguardError
from ._show import age, gpus_used, image_row, size, table

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    ins = sub.add_parser("inspect", help="show one image: processes, GPUs, take point, sizes, checks here",
                         formatter_class=argparse.RawDescriptionHelpFormatter, epilog="""\
DIR: an image directory on this node; the image is verified (marker, manifest, every checksum)
and every restore check runs against this host, as `snapguard preflight --manifest DIR` does.
URL: an image in a store, STORE_URL/JOB/images/NAME as `snapguard images --json` prints it; its
store record and manifest are read (untrusted, schema-checked) and compared with this host's CPU,
kernel and memory; the driver, GPU and CRIU checks need the files: pull it, then inspect the DIR.
exit codes: 0 shown (whatever the checks say: `preflight --manifest` gates), 1 the image could not
be read or is not whole, 2 usage.
""", description="Show one image (a directory or a store URL), text or --json.")
    ins.add_argument("image", metavar="DIR|URL", help="an image directory, or an image's URL in a store")
    ins.add_argument("--json", action="store_true", help="print the image and the checks as JSON")


def _local(path: str) -> tuple[Any, dict[str, Any], list[Any]]:
    from .. import preflight
    from ..config import load

    report = preflight.manifest_report(os.path.abspath(path), load())
    if report.manifest is None:  # not an image snapguard sealed, or a damaged one: the image check says
        raise SnapguardError(*next(((f.reason, f.detail) for c in report.checks for f in c.findings),
                                   (Reason.MANIFEST_INVALID, f"{path}: no image")))
    return report.manifest, {"image": os.path.abspath(path)}, [c.to_dict() for c in report.checks]


def _remote(url: str) -> tuple[Any, dict[str, Any], list[Any]]:
    from .. import image, procfs
    from ..store import open_store, split_image_url, stored_image

    store_url, job, name = split_image_url(url)
    item = stored_image(open_store(store_url), job, name)
    if item.manifest is None:
        raise SnapguardError(Reason.STORE_RECORD_INVALID if item.invalid else Reason.UPLOAD_INCOMPLETE,
                             item.invalid or f"{url}: no manifest (an upload under way or one that died)")
    host = {**procfs.host_facts(), "mem_available": procfs.mem_available_bytes()}
    findings = image.compare_with_host(item.manifest, host, item.manifest.criu_version)
    check = {"name": "image-vs-host", "status": "blocked" if any(f.severity.value == "blocker" for f in findings)
             else "warning" if findings else "ok", "findings": [f.to_dict() for f in findings]}
    return item.manifest, image_row(item), [check]


def run(args: argparse.Namespace) -> int:
    target = args.image
    manifest, where, checks = _remote(target) if "://" in target else _local(target)
    if args.json:
        print(json.dumps({**where, "manifest": manifest.to_json(), "checks": checks}, indent=2, sort_keys=True,
                         default=str))
        return 0
    print(_describe(target, manifest, where, checks))
    return 0


def _describe(target: str, m: Any, where: dict[str, Any], checks: list[dict[str, Any]]) -> str:
    taken = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m.epoch))
    lines = [f"Image:        {target}"]
    if "job" in where:
        lines += [f"Job:          {where['job']} (image {where['name']}, pushed under epoch {where['epoch']}; the "
                  f"job's epoch is {where['job_epoch']}{', SUPERSEDED' if where['superseded'] else ''})"]
    lines += [f"Taken:        {taken} ({age(m.epoch)} ago) on {m.host.hostname} ({m.host.arch}, kernel "
              f"{m.host.kernel})",
              f"Written by:   snapguard {m.snapguard_version}, CRIU {m.criu_version}",
              f"Size:         {size(m.image_bytes)} in {len(m.files)} files",
              f"Fence epoch:  {'-' if m.fence_epoch is None else m.fence_epoch}",
              f"Container:    {m.container_id or '-'}" + (" (bare process tree)" if m.bare else ""),
              f"Network:      {'own namespace' if m.own_netns else 'host namespace'}, lock "
              f"{m.network_lock or '-'}, {m.tcp_connections or 0} TCP connection(s)", "", "Processes:"]
    lines.append(_indent(table(["PID", "NSPID", "COMM", "GPU", "GPU MEM", "RSS"],
                               [[str(p.pid), str(p.nspid), p.comm, "yes" if p.gpu else "no",
                                 size(p.gpu_memory_bytes) if p.gpu else "-", size(p.rss_bytes)]
                                for p in m.processes])))
    gpu = m.gpu or {}
    lines += ["", f"GPUs:         driver {gpu.get('driver_version', '-')}" if gpu else "GPUs:         none"]
    if gpu:
        lines.append(_indent(table(["INDEX", "NAME", "UUID", "MEMORY", "USED BY IMAGE"],
                                   [[str(g.get("index")), str(g.get("name")), str(g.get("uuid")),
                                     size(g.get("memory_total")), size(g.get("used_by_image"))]
                                    for g in m.gpus])) + f"\n  ({len(gpus_used(m))} used by the image)")
    lines += ["", "Take point:" + ("" if m.take_point else "   none (not held at a step boundary)")]
    for pid, figures in sorted(m.take_point.items()):
        shown = ", ".join(f"{k} {v}" for k, v in sorted(figures.items()) if not isinstance(v, (dict, list))) \
            if isinstance(figures, dict) else str(figures)
        lines.append(f"  pid {pid}: {shown[:400]}")
    lines += ["", "Checks against this host:"]
    rows = []
    for c in checks:
        why = "; ".join(f"{f['reason']}: {f['detail']}" for f in c.get("findings", [])) or c.get("error") or ""
        rows.append([c["name"], c["status"], why[:160]])
    lines.append(_indent(table(["CHECK", "RESULT", "DETAIL"], rows)))
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
