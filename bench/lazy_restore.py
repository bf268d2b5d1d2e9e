"""CRIU's lazy pages against its eager restore, on one process and one image, in the same command.

    python3 bench/lazy_restore.py OUT.json [--mb 1024] [--rounds 4] [--criu /usr/local/sbin/criu]

A holder process (this interpreter, stdlib only) fills --mb MiB of memory with random bytes and
waits; CRIU dumps it once. Each round restores that image twice, eagerly (`criu restore`) and
lazily (`criu lazy-pages` serving the image beside `criu restore --lazy-pages`), the order
alternated by round, each from a warm and then from a dropped page cache. After each restore the
holder is told to read one byte of every page (a trainer's first step touches much of its memory),
and the times from the restore call are: CRIU's return, every page read by the holder (its answer),
and, lazily, the lazy-pages daemon's exit (every page copied in). The table gives the medians;
JSON has every sample. Run as root. CPU only: the question it answers is whether lazy pages give a
process its memory sooner than an eager restore; the CUDA plugin is not loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, machine  # noqa: E402

HOLDER = r"""
import os, sys, time
n, go, done = int(sys.argv[1]) << 20, sys.argv[2], sys.argv[3]
b = bytearray(os.urandom(1 << 20)) * (n >> 20)
mv = memoryview(b)
open(done + ".ready", "w").close()
while True:
    if os.path.exists(go):
        os.unlink(go)
        s = sum(mv[i] for i in range(0, n, 4096))
        with open(done + ".tmp", "w") as f:
            f.write(f"{time.time()} {s}\n")
        os.rename(done + ".tmp", done)
    time.sleep(0.002)
"""


def criu(argv: list[str], work: Path, log: str, timeout: float = 120) -> None:
    out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        try:
            said = [ln for ln in (work / log).read_text(errors="replace").splitlines() if "Error" in ln][-3:]
        except OSError:
            said = []
        raise RuntimeError(f"{' '.join(argv[:2])} exited {out.returncode}: {' | '.join(said) or out.stderr[-400:]}")


def wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:g} s")
        time.sleep(0.001)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def gone(pid: int, timeout: float = 10) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.005)


def one(crit: str, images: Path, work: Path, lazy: bool, cold: bool, pid: int) -> dict[str, float]:
    go, done = work / "go", work / "done"
    done.unlink(missing_ok=True)
    if cold:
        drop_caches()
    daemon = None
    t0 = time.time()
    if lazy:
        daemon = subprocess.Popen([crit, "lazy-pages", "-D", str(images), "-W", str(work), "-o", "lazy.log"],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_file(work / "lazy-pages.socket", 10)
    criu([crit, "restore", "-D", str(images), "-W", str(work), "-d", "-o", "restore.log",
          *(["--lazy-pages"] if lazy else [])], work, "restore.log")
    t_ret = time.time()
    go.touch()
    wait_file(done, 60)
    t_read = float(done.read_text().split()[0])
    out = {"restore_return_s": t_ret - t0, "every_page_read_s": t_read - t0}
    if daemon is not None:
        daemon.wait(timeout=60)
        out["lazy_daemon_exit_s"] = time.time() - t0
    gone(pid)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--criu", default="/usr/local/sbin/criu")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="lazy-restore-"))
    images, work = base / "img", base / "work"
    images.mkdir(mode=0o700)
    work.mkdir(mode=0o700)
    holder = subprocess.Popen([sys.executable, "-I", "-S", "-c", HOLDER, str(args.mb), str(work / "go"),
                               str(work / "done")], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    samples: dict[str, list[dict[str, float]]] = {}
    try:
        wait_file(work / "done.ready", 120)
        criu([args.criu, "dump", "-t", str(holder.pid), "-D", str(images), "-W", str(work), "-o", "dump.log"], work, "dump.log")
        holder.wait(timeout=30)
        image_bytes = sum(p.stat().st_size for p in images.iterdir())
        for r in range(args.rounds):
            for lazy in ((False, True) if r % 2 == 0 else (True, False)):
                for cold in (False, True):
                    key = f"{'lazy' if lazy else 'eager'}-{'cold' if cold else 'warm'}"
                    s = one(args.criu, images, work, lazy, cold, holder.pid)
                    samples.setdefault(key, []).append(s)
                    print(f"round {r} {key}: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items()), flush=True)
    finally:
        gone(holder.pid)
        shutil.rmtree(base, ignore_errors=True)
    medians = {k: {m: statistics.median(s[m] for s in v) for m in v[0]} for k, v in samples.items()}
    print(f"\n{args.mb} MiB process, image {image_bytes / 1e9:.2f} GB, medians of {args.rounds} rounds (s from the call)")
    print(f"{'arm':12} {'CRIU returns':>13} {'every page read':>16} {'lazy daemon done':>17}")
    for k in sorted(medians):
        m = medians[k]
        lazy_done = f"{m['lazy_daemon_exit_s']:17.3f}" if "lazy_daemon_exit_s" in m else f"{'-':>17}"
        print(f"{k:12} {m['restore_return_s']:13.3f} {m['every_page_read_s']:16.3f} {lazy_done}")
    Path(args.out).write_text(json.dumps({"benchmark": "lazy-restore", "machine": machine(), "commit": git_rev(),
                                          "date": time.strftime("%Y-%m-%d", time.gmtime()), "mb": args.mb,
                                          "image_bytes": image_bytes, "rounds": args.rounds,
                                          "medians": medians, "samples": samples}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
