"""Probe on the GPU machine: can a DDP trainer's NCCL communicator be released and rebuilt in place
around a CUDA checkpoint, with no trainer code, by a process group whose inner backend is
replaceable?

The trainer (world size 1, DDP over NCCL, an explicit all_reduce each step as well) registers a
Python process-group backend `sgnccl` (torch.distributed.Backend.register_backend) that delegates
every collective to an inner ProcessGroupNCCL. At step K it stops on a line from its parent; the
parent then checkpoints its CUDA state with the driver tool (`cuda-checkpoint --toggle`) and, in
the last arm, takes a leave-running snapshot through snapguard. Arms:

  reference   K never reached: the uninterrupted losses
  live        the communicator left as it is: does the driver checkpoint a process with one?
  rebuilt     the inner backend shut down and dropped first, rebuilt on a new store prefix after
  snapshot    as rebuilt, then `snapguard.pipeline.checkpoint_pid(..., leave_running=True)`
              between the drop and the rebuild: what snapguard's checks say of such a process
  snapshot-uv-no-uring, snapshot-no-libuv
              as snapshot, with libuv's io_uring off (UV_USE_IO_URING=0) or c10d's TCPStore on its
              pre-libuv backend (USE_LIBUV=0): which one leaves no io_uring instance

Every arm's per-step loss bits are compared with the reference. Usage: nccl_rebuild_probe.py OUT
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

TRAINER = r'''
import gc, os, struct, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch.distributed import ProcessGroupNCCL

STEPS, K, MODE, GO = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]

class Swappable(dist.ProcessGroup):
    def __init__(self, store, rank, size):
        super().__init__(rank, size)
        self.store, self.gen, self.inner = store, 0, None
        self.configure()
    def configure(self):
        self.gen += 1
        opts = ProcessGroupNCCL.Options()
        self.inner = ProcessGroupNCCL(dist.PrefixStore(f"g{self.gen}/", self.store), self.rank(), self.size(), opts)
    def drop(self):
        inner, self.inner = self.inner, None
        torch.cuda.synchronize()
        for name in ("shutdown", "abort"):
            if hasattr(inner, name):
                getattr(inner, name)()
                break
        del inner
        gc.collect()
        torch.cuda.synchronize()
    def allreduce(self, *a, **k): return self.inner.allreduce(*a, **k)
    def broadcast(self, *a, **k): return self.inner.broadcast(*a, **k)
    def allgather(self, *a, **k): return self.inner.allgather(*a, **k)
    def _allgather_base(self, *a, **k): return self.inner._allgather_base(*a, **k)
    def allgather_into_tensor_coalesced(self, *a, **k): return self.inner.allgather_into_tensor_coalesced(*a, **k)
    def reduce_scatter(self, *a, **k): return self.inner.reduce_scatter(*a, **k)
    def _reduce_scatter_base(self, *a, **k): return self.inner._reduce_scatter_base(*a, **k)
    def barrier(self, *a, **k): return self.inner.barrier(*a, **k)
    def getBackendName(self): return "sgnccl"

made = []
def create(store, rank, size, timeout):
    pg = Swappable(store, rank, size); made.append(pg); return pg
dist.Backend.register_backend("sgnccl", create, devices=["cuda"])
torch.cuda.set_device(0)
dist.init_process_group("sgnccl", rank=0, world_size=1)
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
g = torch.Generator(device="cuda").manual_seed(1)
for step in range(STEPS):
    x = torch.randn(64, 512, device="cuda", generator=g)
    loss = (ddp(x) - x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    bits = struct.unpack("<I", struct.pack("<f", float(t)))[0]
    print(f"step {step} {bits:08x}", flush=True)
    if step == K and MODE != "reference":
        if MODE in ("rebuilt", "snapshot"):
            made[0].drop()
        print(f"ready {os.getpid()}", flush=True)
        while not os.path.exists(GO):
            time.sleep(0.01)
        line = "x"
        if MODE in ("rebuilt", "snapshot"):
            t0 = time.perf_counter()
            made[0].configure()
            w = torch.zeros(1, device="cuda"); dist.all_reduce(w); torch.cuda.synchronize()
            print(f"rebuilt {time.perf_counter() - t0:.3f}", flush=True)
        print(f"go {line}", flush=True)
print("done", flush=True)
'''

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
       "MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
TOOL = "/usr/local/bin/cuda-checkpoint"


def tool(*args: str) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([TOOL, *args], capture_output=True, text=True, timeout=120)
    return {"rc": r.returncode, "out": r.stdout.strip()[:200], "err": r.stderr.strip()[:300],
            "s": round(time.perf_counter() - t0, 3)}


VARIANTS = {"snapshot-uv-no-uring": {"UV_USE_IO_URING": "0"}, "snapshot-no-libuv": {"USE_LIBUV": "0"}}


def io_urings(pid: int) -> int:
    """The io_uring instances among pid's descriptors."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[io_uring]"
        except OSError:
            pass
    return n


def arm(mode: str, port: int, steps: int, k: int, work: Path) -> dict:
    """One trainer run; its output goes to a file and its go-ahead is a file (no pipe to this
    process, which CRIU would have to carry)."""
    env = {**os.environ, **ENV, "MASTER_PORT": str(port), **VARIANTS.get(mode, {})}
    trainer_mode = "snapshot" if mode in VARIANTS else mode
    log, go = work / f"{mode}.out", work / f"{mode}.go"
    for f in (log, go):
        f.unlink(missing_ok=True)
    p = subprocess.Popen([sys.executable, "-c", TRAINER, str(steps), str(k), trainer_mode, str(go)], env=env,
                         stdin=subprocess.DEVNULL, stdout=open(log, "w"), stderr=open(work / f"{mode}.err", "w"),
                         start_new_session=True)
    res: dict = {"mode": mode}
    deadline, seen = time.monotonic() + 240, 0
    while p.poll() is None and time.monotonic() < deadline:
        lines = log.read_text().splitlines()
        for line in lines[seen:]:
            word = line.split()
            if word and word[0] == "ready":
                pid = int(word[1])
                res["io_urings"] = io_urings(pid)
                res["state_before"] = tool("--get-state", "--pid", str(pid))
                res["toggle_out"] = tool("--toggle", "--pid", str(pid))
                res["state_out"] = tool("--get-state", "--pid", str(pid))
                if res["toggle_out"]["rc"] == 0:
                    res["toggle_back"] = tool("--toggle", "--pid", str(pid))
                if trainer_mode == "snapshot":
                    res["snapshot"] = snapshot(pid, work)
                go.write_text("go\n")
        seen = len(lines)
        time.sleep(0.05)
    if p.poll() is None:
        p.kill()
        res["error"] = "deadline"
    p.wait(timeout=60)
    words = [line.split() for line in log.read_text().splitlines() if line.strip()]
    res["losses"] = [w[2] for w in words if w[0] == "step"]
    res["rebuild_s"] = next((float(w[1]) for w in words if w[0] == "rebuilt"), None)
    res["done"] = any(w[0] == "done" for w in words)
    res["rc"] = p.returncode
    res["stderr_tail"] = (work / f"{mode}.err").read_text()[-1500:]
    return res


def snapshot(pid: int, work: Path) -> dict:
    from snapguard.config import load
    from snapguard.pipeline import checkpoint_pid
    from snapguard.reasons import SnapguardError

    t0 = time.perf_counter()
    try:
        ck = checkpoint_pid(pid, str(work / "snap.img"), load(), leave_running=True)
    except SnapguardError as e:
        return {"ok": False, "reason": e.reason.name, "detail": str(e)[:600], "s": round(time.perf_counter() - t0, 3)}
    return {"ok": True, "image_bytes": ck["image_bytes"], "timings": ck["timings"],
            "warnings": [w.get("reason") if isinstance(w, dict) else str(w) for w in ck.get("warnings", [])],
            "s": round(time.perf_counter() - t0, 3)}


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/nccl-probe")
    work.mkdir(exist_ok=True)
    steps, k = 40, 15
    results = {}
    for i, mode in enumerate(("reference", "live", "rebuilt", "snapshot", *VARIANTS)):
        results[mode] = arm(mode, 29700 + i, steps, k, work)
        print(mode, {x: results[mode].get(x) for x in ("rc", "toggle_out", "toggle_back", "rebuild_s", "snapshot")},
              flush=True)
    ref = results["reference"]["losses"]
    for mode, r in results.items():
        r["bit_identical"] = r["losses"] == ref and len(ref) == steps
    (out / "nccl-rebuild.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"{'arm':20} {'rc':>3} {'toggle out':>10} {'back':>5} {'rebuild s':>9} {'snapshot':>24} bit-identical")
    for mode, r in results.items():
        print(f"{mode}: io_uring instances at the hold: {r.get('io_urings', '-')}")
    for mode, r in results.items():
        snap = r.get("snapshot") or {}
        snap_s = ("ok" if snap.get("ok") else snap.get("reason", "")) if snap else "-"
        print(f"{mode:20} {r['rc']:>3} {str((r.get('toggle_out') or {}).get('rc', '-')):>10} "
              f"{str((r.get('toggle_back') or {}).get('rc', '-')):>5} {str(r.get('rebuild_s', '-')):>9} "
              f"{snap_s:>24} {'yes' if r['bit_identical'] else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
