"""CRIU's lazy pages against its eager restore, on one process and one image, in the same command.

    python3 bench/lazy_restore.py OUT.json [--mb 1024] [--rounds 4] [--criu /usr/local/sbin/criu]
    python3 bench/lazy_restore.py OUT.json --cuda [--gpu-mb 512]   # on a GPU machine, after setup.sh

A holder process (this interpreter, stdlib only) fills --mb MiB of memory with random bytes and
waits; CRIU dumps it once. Each round restores that image twice, eagerly (`criu restore`) and
lazily (`criu lazy-pages` serving the image beside `criu restore --lazy-pages`), the order
alternated by round, each from a warm and then from a dropped page cache. After each restore the
holder is told to read one byte of every page (a trainer's first step touches much of its memory),
and the times from the restore call are: CRIU's return, every page read by the holder (its answer),
and, lazily, the lazy-pages daemon's exit (every page copied in). The table gives the medians;
JSON has every sample. Run as root. The question it answers is whether lazy pages give a process
its memory sooner than an eager restore. With --cuda the holder also holds --gpu-mb MiB on the GPU
(torch, random values), CRIU runs with snapguard's CUDA plugin directory and cuda-checkpoint on its
PATH (as scaling.py's raw arm), and each restore's answer also says whether the device's bytes came
back (their sum against the one taken before the dump): the plugin's device copy lies in the
restored process's pages, which lazily come in only on the driver's own faults.
"""

from __future__ import annotations

import argparse
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
from _common import git_rev, write  # noqa: E402

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


CUDA_HOLDER = r"""
import os, sys, time
import torch
n, go, done, gpu = int(sys.argv[1]) << 20, sys.argv[2], sys.argv[3], int(sys.argv[4]) << 20
b = bytearray(os.urandom(1 << 20)) * (n >> 20)
mv = memoryview(b)
g = torch.randint(0, 1 << 30, (gpu // 8,), dtype=torch.int64, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
want = int(g.sum())
torch.cuda.synchronize()
open(done + ".ready", "w").close()
while True:
    if os.path.exists(go):
        os.unlink(go)
        s = sum(mv[i] for i in range(0, n, 4096))
        ok = int(g.sum()) == want
        with open(done + ".tmp", "w") as f:
            f.write(f"{time.time()} {s} {int(ok)}\n")
        os.rename(done + ".tmp", done)
    time.sleep(0.002)
"""


def criu(argv: list[str], work: Path, log: str, timeout: float = 120, env: dict[str, str] | None = None) -> None:
    out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        try:
            said = [ln for ln in (work / log).read_text(errors="replace").splitlines() if "Error" in ln][-3:]
        except OSError:
            said = []
        raise RuntimeError(f"{' '.join(argv[:2])} exited {out.returncode}: {' | '.join(said) or out.stderr[-400:]}")


def wait_file(path: Path, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the holder exited {proc.returncode} before {path.name}")
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


def one(crit: str, images: Path, work: Path, lazy: bool, cold: bool, pid: int, more: list[str],
        env: dict[str, str] | None) -> dict[str, float]:
    go, done = work / "go", work / "done"
    done.unlink(missing_ok=True)
    if cold:
        drop_caches()
    daemon = None
    t0 = time.time()
    if lazy:
        daemon = subprocess.Popen([crit, "lazy-pages", "-D", str(images), "-W", str(work), "-o", "lazy.log", *more],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env=env)
        wait_file(work / "lazy-pages.socket", 10)
    criu([crit, "restore", "-D", str(images), "-W", str(work), "-d", "-o", "restore.log",
          *(["--lazy-pages"] if lazy else []), *more], work, "restore.log", env=env)
    t_ret = time.time()
    go.touch()
    wait_file(done, 60)
    said = done.read_text().split()
    out = {"restore_return_s": t_ret - t0, "every_page_read_s": float(said[0]) - t0}
    if len(said) > 2:
        out["device_bytes_ok"] = float(said[2])  # 1.0: the GPU's bytes summed as before the dump
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
    ap.add_argument("--cuda", action="store_true", help="a CUDA holder, CRIU with its CUDA plugin")
    ap.add_argument("--gpu-mb", type=int, default=512)
    args = ap.parse_args()
    more: list[str] = []
    env: dict[str, str] | None = None
    if args.cuda:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from snapguard.config import load, resolve_cuda_checkpoint

        config = load()
        tool = resolve_cuda_checkpoint(config)
        if not tool:
            raise SystemExit("lazy_restore: --cuda needs cuda-checkpoint (snapguard's config names none)")
        args.criu = config.criu
        more = ["--libdir", config.criu_libdir]
        env = {**os.environ, "PATH": f"{os.path.dirname(tool)}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    base = Path(tempfile.mkdtemp(prefix="lazy-restore-"))
    images, work = base / "img", base / "work"
    images.mkdir(mode=0o700)
    work.mkdir(mode=0o700)
    code = [CUDA_HOLDER, str(args.mb), str(work / "go"), str(work / "done"), str(args.gpu_mb)] if args.cuda else \
        [HOLDER, str(args.mb), str(work / "go"), str(work / "done")]
    holder = subprocess.Popen([sys.executable, *([] if args.cuda else ["-I", "-S"]), "-c", *code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)  # a file CRIU would check the size of
    samples: dict[str, list[dict[str, float]]] = {}
    try:
        wait_file(work / "done.ready", 120, holder)
        criu([args.criu, "dump", "-t", str(holder.pid), "-D", str(images), "-W", str(work), "-o", "dump.log", *more], work,
             "dump.log", env=env)
        holder.wait(timeout=30)
        image_bytes = sum(p.stat().st_size for p in images.iterdir())
        for r in range(args.rounds):
            for lazy in ((False, True) if r % 2 == 0 else (True, False)):
                for cold in (False, True):
                    key = f"{'lazy' if lazy else 'eager'}-{'cold' if cold else 'warm'}"
                    s = one(args.criu, images, work, lazy, cold, holder.pid, more, env)
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
    write("lazy-restore", {"commit": git_rev(), "mb": args.mb, "cuda": args.cuda,
                           "gpu_mb": args.gpu_mb if args.cuda else None, "image_bytes": image_bytes,
                           "rounds": args.rounds, "medians": medians, "samples": samples}, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
