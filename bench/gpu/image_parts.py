"""Where the bytes of a snapshot image go: every file by kind, and CRIU's memory pages by the VMA
they belong to, read from the image itself (CRIU's pagemap-PID.img and mm-PID.img, protobuf
entries, decoded here without crit).

The image's files: `pages` (pages-N.img: every dumped page), the take point's spill (the moved
optimizer tensors, beside CRIU's files), and the rest (CRIU's small images, the manifest). The pages
by VMA: each VMA of mm-PID.img with the dumped pages inside it, by CRIU's kind (anon private, heap,
stack, file private, anon shared, memfd, ...) and, given the live process after a leave-running
dump (--pid), whether a mapping still starts where the VMA did in it: a VMA that was there only
while the process was suspended holds what the CUDA plugin's checkpoint put in host memory (the
device's bytes, copied out by the driver), since the process runs no code of its own in that time.
Mapped file paths come from /proc/PID/maps of the live process where the range matches.
Each kind's `zero_page_bytes_by_kind` too: its dumped pages that hold only zeros (read from the
pages files, which hold each pagemap's present pages in its order): what a sparse image, or a
transfer that skips them, would not carry.

    python3 bench/gpu/image_parts.py IMAGE_DIR [--pid PID] [--top 12]     # JSON on stdout
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import sys
from typing import Any

PAGE = 4096
# CRIU's VMA status bits (criu/include/image.h)
KINDS = ((1 << 5, "heap"), (1 << 1, "stack"), (1 << 14, "memfd"), (1 << 8, "anon shared"), (1 << 10, "sysv shm"),
         (1 << 6, "file private"), (1 << 7, "file shared"), (1 << 9, "anon private"), (1 << 3, "vdso"),
         (1 << 12, "vvar"))
PE_PRESENT = 4  # pagemap_entry.flags: the pages are in pages-N.img (PE_PARENT 1, PE_LAZY 2)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 70:
            raise ValueError("a varint longer than 10 bytes")


def decode(buf: bytes) -> dict[int, list[Any]]:
    """One protobuf message: {field number: [values]} (varints as ints, length-delimited as
    bytes, fixed 32/64 as ints)."""
    out: dict[int, list[Any]] = {}
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire == 1:
            value, i = int.from_bytes(buf[i:i + 8], "little"), i + 8
        elif wire == 5:
            value, i = int.from_bytes(buf[i:i + 4], "little"), i + 4
        else:
            raise ValueError(f"protobuf wire type {wire} is not one CRIU's images use")
        out.setdefault(field, []).append(value)
    return out


def entries(path: str) -> list[bytes]:
    """The entries of a CRIU protobuf image: two magics (u32 each), then u32 size + message."""
    with open(path, "rb") as f:
        data = f.read()
    i, out = 8, []
    while i + 4 <= len(data):
        n = int.from_bytes(data[i:i + 4], "little")
        out.append(data[i + 4:i + 4 + n])
        i += 4 + n
    return out


def vmas(image_dir: str, pid: int) -> list[dict[str, int]]:
    mm = decode(entries(os.path.join(image_dir, f"mm-{pid}.img"))[0])
    out = []
    for raw in mm.get(14, []):
        v = decode(raw)
        out.append({"start": v[1][0], "end": v[2][0], "status": v[7][0], "flags": v[6][0], "prot": v[5][0]})
    return out


def pages_id(image_dir: str, pid: int | str) -> int:
    """The N of the pages-N.img that pagemap-PID.img's present pages are in (its pagemap_head)."""
    return int(decode(entries(os.path.join(image_dir, f"pagemap-{pid}.img"))[0])[1][0])


ZERO_PAGE = bytes(PAGE)


def zero_bytes(f: Any, offset: int, length: int) -> int:
    """Bytes of the all-zero pages among `length` bytes of the open pages file `f` at `offset`."""
    zeros, done = 0, 0
    while done < length:
        chunk = os.pread(f.fileno(), min(64 << 20, length - done), offset + done)
        if not chunk:
            break
        mv = memoryview(chunk)
        zeros += sum(PAGE for i in range(0, len(chunk) - PAGE + 1, PAGE) if mv[i:i + PAGE] == ZERO_PAGE)
        done += len(chunk)
    return zeros


def present_pages(image_dir: str, pid: int | str) -> list[tuple[int, int]]:
    """(vaddr, pages) of every entry of pagemap-PID.img (or pagemap-shmem-ID.img, `pid` "shmem-ID")
    whose pages are in this image's pages files."""
    out = []
    for raw in entries(os.path.join(image_dir, f"pagemap-{pid}.img"))[1:]:  # the first: pagemap_head
        e = decode(raw)
        flags = e.get(4, [PE_PRESENT])[0]
        if flags & PE_PRESENT:  # nr_pages (5, a uint64) where CRIU writes it, else compat_nr_pages (2)
            out.append((e[1][0], e[5][0] if 5 in e else e[2][0]))
    return out


def kind(status: int) -> str:
    return next((name for bit, name in KINDS if status & bit), f"status {status:#x}")


def live_maps(pid: int) -> dict[int, str]:
    """start -> the mapped path ('' for anonymous) of each mapping of the live process."""
    out = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo = int(parts[0].split("-")[0], 16)
                out[lo] = parts[5].strip() if len(parts) > 5 else ""
    except OSError:
        pass
    return out


def account(image_dir: str, live_pid: int | None = None, top: int = 12) -> dict[str, Any]:
    files: dict[str, int] = {"pages": 0, "spill": 0, "other": 0}
    pids, shared = [], []
    for name in os.listdir(image_dir):
        p = os.path.join(image_dir, name)
        if not os.path.isfile(p) or os.path.islink(p):
            continue
        size = os.path.getsize(p)
        if name.startswith("pages-"):
            files["pages"] += size
        elif "spill" in name or name.startswith("snapguard-take-"):
            files["spill"] += size
        else:
            files["other"] += size
        m = re.fullmatch(r"pagemap-(\d+)\.img", name)  # pagemap-shmem-ID.img: shared memory's, below
        if m:
            pids.append(int(m.group(1)))
        m = re.fullmatch(r"pagemap-(shmem-\d+)\.img", name)
        if m:
            shared.append(m.group(1))
    maps = live_maps(live_pid) if live_pid else {}
    by_kind: dict[str, int] = {}
    zeros_by_kind: dict[str, int] = {}
    offsets: dict[int, int] = {}  # pages-N.img: how far its pages are accounted
    rows = []
    for pid in sorted(pids):
        areas = sorted(vmas(image_dir, pid), key=lambda v: v["start"])
        counted = {i: 0 for i in range(len(areas))}
        zeros = {i: 0 for i in range(len(areas))}
        starts = [v["start"] for v in areas]
        pid_pages = pages_id(image_dir, pid)
        with open(os.path.join(image_dir, f"pages-{pid_pages}.img"), "rb") as f:
            for vaddr, n in present_pages(image_dir, pid):
                at = offsets.get(pid_pages, 0)  # the entry's first page in the pages file
                lo, hi = vaddr, vaddr + n * PAGE
                i = max(0, bisect.bisect_right(starts, lo) - 1)
                while lo < hi and i < len(areas):  # an entry may span adjacent VMAs
                    a = areas[i]
                    part = max(0, min(hi, a["end"]) - max(lo, a["start"]))
                    counted[i] += part
                    if part:
                        zeros[i] += zero_bytes(f, at + max(lo, a["start"]) - vaddr, part)
                    lo = max(lo, min(hi, a["end"]))
                    i += 1
                offsets[pid_pages] = at + n * PAGE
        for i, a in enumerate(areas):
            if not counted[i]:
                continue
            k = kind(a["status"])
            still = a["start"] in maps if live_pid else None  # by start: the heap's end moves
            label = k if still is not False else f"{k}, gone after the dump"
            by_kind[label] = by_kind.get(label, 0) + counted[i]
            zeros_by_kind[label] = zeros_by_kind.get(label, 0) + zeros[i]
            rows.append({"pid": pid, "start": hex(a["start"]), "size": a["end"] - a["start"], "dumped": counted[i],
                         "zero": zeros[i], "kind": k, "mapped_after": still, "path": maps.get(a["start"])})
    for sid in shared:  # shared anonymous memory: its pages once, not per process that maps it
        n = sum(pages for _, pages in present_pages(image_dir, sid)) * PAGE
        if n:
            sid_pages = pages_id(image_dir, sid)
            with open(os.path.join(image_dir, f"pages-{sid_pages}.img"), "rb") as f:
                z = zero_bytes(f, offsets.get(sid_pages, 0), n)
            offsets[sid_pages] = offsets.get(sid_pages, 0) + n
            by_kind["anon shared (shmem)"] = by_kind.get("anon shared (shmem)", 0) + n
            zeros_by_kind["anon shared (shmem)"] = zeros_by_kind.get("anon shared (shmem)", 0) + z
            rows.append({"shmem": sid, "dumped": n, "zero": z, "kind": "anon shared (shmem)"})
    rows.sort(key=lambda r: -r["dumped"])
    dumped = sum(by_kind.values())
    return {"image": image_dir, "files_bytes": files, "total_bytes": sum(files.values()),
            "dumped_page_bytes": dumped, "pages_file_matches": dumped == files["pages"],
            "pages_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "zero_page_bytes": sum(zeros_by_kind.values()),
            "zero_page_bytes_by_kind": {k: zeros_by_kind.get(k, 0) for k in sorted(by_kind, key=lambda k: -by_kind[k])},
            "vmas_dumped": len(rows), "largest_vmas": rows[:top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("image_dir")
    ap.add_argument("--pid", type=int, help="the live process after a leave-running dump (VMAs still mapped)")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    try:
        out = account(args.image_dir, args.pid, args.top)
    except (OSError, ValueError, IndexError, KeyError) as e:
        print(f"image_parts: {args.image_dir}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
