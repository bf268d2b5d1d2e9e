"""One rank of a small data-parallel job (torch.distributed, gloo), for coordinated snapshots.

Deterministic: the data of a step depends on (step, rank) alone. Each rank appends
`step <n> <loss as float32 hex> <unix time>` to <out>/rank<r>.log and writes SHA-256 digests of its
parameters, optimizer and RNG state to <out>/rank<r>.result.json at the end. Started by launch.py.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import struct
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def digest(obj: object) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu",
                    help="cpu, or cuda: rank r uses GPU r mod the GPU count (one GPU: the ranks share it)")
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--step-sleep", type=float, default=0.05, help="seconds per step outside the math")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = f"cuda:{rank % torch.cuda.device_count()}" if args.device == "cuda" else args.device
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 10)).to(device)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    log = open(os.path.join(args.out, f"rank{rank}.log"), "a", buffering=1)
    for step in range(1, args.steps + 1):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(32, 64, generator=g).to(device)
        y = torch.randint(0, 10, (32,), generator=g).to(device)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log.write(f"step {step} {struct.pack('>f', loss.item()).hex()} {time.time():.6f}\n")
        time.sleep(args.step_sleep)
    dist.barrier()
    state = {"params": digest({k: v.cpu() for k, v in model.state_dict().items()}),
             "optimizer": digest({k: {n: t.cpu() if torch.is_tensor(t) else t for n, t in s.items()}
                                  for k, s in opt.state_dict()["state"].items()}),
             "rng": digest(torch.get_rng_state())}
    path = os.path.join(args.out, f"rank{rank}.result.json")
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
