"""What the take point's spill carries could lose losslessly: the torch workload's GPT (train.py,
bf16 autocast, AdamW) stepped a few times on the CPU, then for each part of the state the spill
holds (parameters, gradients, AdamW's two moments, all fp32): the share of elements whose low 16
bits are zero (exactly bf16, so storable in half the bytes), and zlib level 1's ratio on the raw and
on the byte-shuffled bytes (and its single-thread rate here).

    .venv/bin/python bench/spill_parts.py [--width 768 --layers 2 --steps 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

TRAIN = Path(__file__).resolve().parents[1] / "lab" / "snapguard_lab" / "workloads" / "torch" / "train.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("train", TRAIN)
    assert spec is not None and spec.loader is not None
    t = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(t)
    torch.manual_seed(1234)
    m = t.GPT(d=args.width, layers=args.layers)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.1)
    for step in range(1, args.steps + 1):
        x, y = t.batch(step, 2, "cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(x).float().view(-1, t.VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    parts = {"params": [p.detach() for p in m.parameters()], "grads": [p.grad for p in m.parameters()],
             "exp_avg": [s["exp_avg"] for s in opt.state.values()],
             "exp_avg_sq": [s["exp_avg_sq"] for s in opt.state.values()]}
    out = {"width": args.width, "layers": args.layers, "steps": args.steps, "parts": {}}
    for name, tensors in parts.items():
        words = np.concatenate([x.float().numpy().ravel() for x in tensors]).view(np.uint32)
        raw = words.tobytes()
        t0 = time.monotonic()
        z = len(zlib.compress(raw, 1))
        rate = len(raw) / (time.monotonic() - t0) / 1e6
        shuffled = words.view(np.uint8).reshape(-1, 4).T.copy().tobytes()
        exact_tensors = sum(x.numel() for x in tensors if not ((x.float().numpy().view(np.uint32) & 0xFFFF) != 0).any())
        out["parts"][name] = {"bytes": len(raw), "bf16_exact_elements": float(((words & 0xFFFF) == 0).mean()),
                              "bf16_exact_whole_tensors": exact_tensors / words.size,
                              "zlib1": round(z / len(raw), 3), "zlib1_byte_shuffled":
                                  round(len(zlib.compress(shuffled, 1)) / len(raw), 3), "zlib1_mb_s": round(rate)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
