"""A trainer with a large host memory footprint, for bench/gpu/scaling.py --trainer: the torch
workload's train.py (the same GPT, bf16 autocast, AdamW, deterministic), but each step's batch is
read from a tokenized dataset held in CPU memory (`--host-data-gb` GB of int32 tokens, built once
at start from a fixed seed), as a trainer that loaded its corpus into RAM does. The dataset is
pageable host memory the process touches once when it builds it and then reads a window of each
step: what CRIU must carry in the image, and what a file checkpoint (torch.save of the model and
optimizer) leaves out and a resumed trainer builds again.

    python3 bench/gpu/host_data_trainer.py --host-data-gb 8 [train.py's arguments]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "lab" / "snapguard_lab" / "workloads" / "torch" / "train.py"


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--host-data-gb", type=float, default=4.0)
    own, rest = ap.parse_known_args()
    spec = importlib.util.spec_from_file_location("train", TRAIN)
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    import torch

    tokens = int(own.host_data_gb * (1 << 30)) // 4
    g = torch.Generator(device="cpu").manual_seed(20261203)
    data = torch.empty(tokens, dtype=torch.int32)
    chunk = 1 << 26
    for at in range(0, tokens, chunk):  # in pieces: no second copy of the whole at any time
        n = min(chunk, tokens - at)
        data[at:at + n] = torch.randint(0, train.VOCAB, (n,), generator=g, dtype=torch.int32)
    ctx = train.CTX

    def batch(step: int, size: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        span = size * (ctx + 1)
        start = (step * 7919 * span) % max(tokens - span, 1)
        seq = data[start:start + span].view(size, ctx + 1).long().to(device)
        return seq[:, :-1], seq[:, 1:]

    train.batch = batch
    sys.argv = [str(TRAIN), *rest]
    train.main()


if __name__ == "__main__":
    main()
