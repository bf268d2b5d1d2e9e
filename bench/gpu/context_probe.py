"""What a trainer's process holds besides its tensors, the part of a snapshot image that is neither
the spill nor the optimizer's state: the device memory the CUDA context keeps (what the CUDA
plugin's checkpoint copies into host memory) and the process's resident anonymous memory by
mapping (what CRIU writes as pages).

The drill's GPT (lab/snapguard_lab/workloads/torch/train.py, bf16 autocast, AdamW) stepped a few
times; then, one after another, what the take point's trim does and what it might do besides, each
with the device memory in use (cudaMemGetInfo: total - free; the process is alone on the GPU) and
torch's reserve after it: the allocator's cache emptied, cuBLAS's workspaces freed, the pinned host
cache emptied, the optimizer's tensors moved out (resize_(0), as the take point's Offload), then
the CUDA runtime's limits lowered (stack size per thread, the device malloc heap, the printf FIFO:
cudaDeviceSetLimit, which sizes the context's own reservations). Last, the largest resident
anonymous mappings of the process (/proc/self/smaps) with what maps them.

    python3 bench/gpu/context_probe.py OUT.json [--width 768 --layers 12 --batch 16]
    .venv/bin/python bench/gpu/context_probe.py /tmp/c.json --device cpu --width 96 --layers 2  # the host part
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lab" / "snapguard_lab" / "workloads" / "torch"))

LIMITS = {"stack_size": 0, "printf_fifo_size": 1, "malloc_heap_size": 2}  # cudaLimit enum values


def smaps_top(n: int = 16) -> dict[str, Any]:
    """RssAnon of this process and its `n` largest mappings by anonymous resident bytes."""
    rows, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                cur = {"range": head[0], "path": head[5] if len(head) > 5 else "", "anon": 0, "rss": 0}
                rows.append(cur)
            elif cur is not None and head[0] == "Anonymous:":
                cur["anon"] = int(head[1]) * 1024
            elif cur is not None and head[0] == "Rss:":
                cur["rss"] = int(head[1]) * 1024
    by_path: dict[str, int] = {}
    for r in rows:
        by_path[r["path"] or "[anon]"] = by_path.get(r["path"] or "[anon]", 0) + r["anon"]
    rows.sort(key=lambda r: -r["anon"])
    return {"anon_bytes": sum(r["anon"] for r in rows),
            "anon_by_path": dict(sorted(((k, v) for k, v in by_path.items() if v), key=lambda kv: -kv[1])[:n]),
            "largest": [{**r, "size": int(r["range"].split("-")[1], 16) - int(r["range"].split("-")[0], 16)}
                        for r in rows[:n]]}


def cudart() -> ctypes.CDLL | None:
    """The CUDA runtime PyTorch loaded (found in this process's maps, opened by that path)."""
    with open("/proc/self/maps") as f:
        paths = {ln.split()[-1] for ln in f if "libcudart.so" in ln}
    return ctypes.CDLL(sorted(paths)[0]) if paths else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    import train

    dev = args.device
    out: dict[str, Any] = {"argv": sys.argv[1:], "torch": torch.__version__, "stages": []}

    def used() -> int | None:
        if dev != "cuda":
            return None
        free, total = torch.cuda.mem_get_info()
        return int(total - free)

    def stage(name: str) -> None:
        if dev == "cuda":
            torch.cuda.synchronize()
        out["stages"].append({"stage": name, "device_used": used(),
                              "reserved": torch.cuda.memory_reserved() if dev == "cuda" else None,
                              "host_anon": smaps_top(0)["anon_bytes"], "t": time.time()})
        print(json.dumps(out["stages"][-1]), flush=True)

    if dev == "cuda":
        torch.cuda.init()
        torch.zeros(1, device="cuda")
        stage("context")
    torch.manual_seed(1234)
    model = train.GPT(d=args.width, layers=args.layers).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    for step in range(1, args.steps + 1):
        x, y = train.batch(step, args.batch, dev)
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().view(-1, train.VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    loss.item()
    stage("stepped")
    if dev == "cuda":
        torch.cuda.empty_cache()
        stage("empty_cache")
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
            torch.cuda.empty_cache()
        stage("cublas_workspaces")
    host_empty = getattr(torch._C, "_host_emptyCache", None)
    if host_empty is not None:
        host_empty()
    stage("host_cache")
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors if t.device.type == dev}
    out["optimizer_bytes"] = sum(s.nbytes() for s in storages.values())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    out["grad_bytes"] = sum(g.numel() * g.element_size() for g in grads)
    out["grad_bytes_bf16_exact"] = sum(g.numel() * g.element_size() for g in grads
                                       if not (g.view(torch.int32) & 0xFFFF).any().item())
    for s in storages.values():
        s.resize_(0)
    if dev == "cuda":
        torch.cuda.empty_cache()
    stage("optimizer_moved")
    rt = cudart() if dev == "cuda" else None
    if rt is not None:
        limits = {}
        for name, code in LIMITS.items():
            v = ctypes.c_size_t()
            rc = rt.cudaDeviceGetLimit(ctypes.byref(v), code)
            limits[name] = v.value if rc == 0 else f"rc {rc}"
        out["limits_before"] = limits
        for name, value in (("stack_size", 0), ("malloc_heap_size", 0), ("printf_fifo_size", 0)):
            rc = rt.cudaDeviceSetLimit(LIMITS[name], ctypes.c_size_t(value))
            after = ctypes.c_size_t()
            rt.cudaDeviceGetLimit(ctypes.byref(after), LIMITS[name])
            out.setdefault("limit_set", {})[name] = {"asked": value, "rc": rc, "now": after.value}
            stage(f"limit {name} lowered")
    out["smaps"] = smaps_top(16)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("optimizer_bytes", "grad_bytes", "grad_bytes_bf16_exact")}))


if __name__ == "__main__":
    main()
