"""What the workload matrix's trainers share (each row is a script in this directory, run by path,
so this directory is sys.path[0] for it): arguments, determinism, a small deterministic model and
data made from the step number, the per-step log and the digests at the end.

The log is the torch drill's (workloads/torch/train.py), so its comparison code reads it:
    step <n> <loss as float32 hex> <unix time> <reserved bytes>
opened O_APPEND (CRIU does not size-check such files at restore); other lines (`start ...`,
`micro <step> <k> <time>`) are ignored by the comparison. The result (--result) holds SHA-256
digests of parameters, optimizer state and RNG state, and whatever the row adds.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch: deterministic cuBLAS
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # no AMX: CRIU restores no AMX state
for _offline in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_offline, "1")  # nothing is downloaded: models are built from their config
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import struct  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB = 256
# per device: width, layers, batch, sequence length (small on the CPU: the test suite's rows)
SIZES = {"cuda": (1024, 6, 32, 128), "cpu": (64, 2, 8, 32)}
SEED = 1234


def parser(doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--width", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--min-step-s", type=float, default=0.0,
                    help="each optimizer step lasts at least this long (so that a snapshot finds the run going)")
    ap.add_argument("--workdir", help="for a framework's output directory (nothing is saved there)")
    return ap


def setup(args: argparse.Namespace) -> str:
    """Seeds and deterministic kernels; fills the sizes the device's defaults give."""
    width, layers, batch, seq = SIZES[args.device]
    args.width = args.width or width
    args.layers = args.layers or layers
    args.batch = args.batch or batch
    args.seq = args.seq or seq
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if args.device == "cpu":
        torch.set_num_threads(1)  # small CPU runs: one thread is faster on a shared machine, and steadier
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    return args.device


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class TinyLM(nn.Module):
    """Token and position embeddings, residual MLP blocks, a head over 256 byte values."""

    def __init__(self, d: int, layers: int, ctx: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(ctx, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def model_for(args: argparse.Namespace) -> TinyLM:
    return TinyLM(args.width, args.layers, args.seq)


def sample(key: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One text-like sequence from a key alone: a seeded walk over a small alphabet."""
    g = torch.Generator(device="cpu").manual_seed(1_000_003 * key + 7)
    base = torch.randint(97, 123, (1,), generator=g)
    walk = ((base + torch.randint(0, 3, (seq + 1,), generator=g).cumsum(0) - 97) % 26 + 97)
    return walk[:-1], walk[1:]


def batch(key: int, size: int, seq: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(sample(key * 4096 + i, seq) for i in range(size)))
    return torch.stack(xs).to(device), torch.stack(ys).to(device)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


class StepLog:
    """The per-step log; `step` also paces the run (--min-step-s)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.t_start = time.time()
        self.device = args.device
        self.min_step_s = args.min_step_s
        self.f = open(args.log, "a", buffering=1)
        self.last = time.monotonic()

    def start(self, model: nn.Module) -> None:
        self.f.write(f"start {os.getpid()} {self.t_start:.6f} {time.time():.6f} "
                     f"{sum(p.numel() for p in model.parameters())}\n")
        self.last = time.monotonic()

    def note(self, text: str) -> None:
        self.f.write(f"{text} {time.time():.6f}\n")

    def step(self, n: int, loss: Any) -> None:
        value = float(loss.item() if torch.is_tensor(loss) else loss)
        pause = self.min_step_s - (time.monotonic() - self.last)
        if pause > 0:
            time.sleep(pause)
        reserved = torch.cuda.memory_reserved() if self.device == "cuda" else 0
        self.f.write(f"step {n} {struct.pack('>f', value).hex()} {time.time():.6f} {reserved}\n")
        self.last = time.monotonic()


def digest(obj: object) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def _cpu(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def finish(args: argparse.Namespace, model: nn.Module, optimizer: Any, **extra: Any) -> None:
    """Digests of parameters, optimizer state and RNG state (and `extra`) into --result, atomically."""
    rng = {"rng": torch.get_rng_state(),
           **({"cuda_rng": torch.cuda.get_rng_state()} if args.device == "cuda" else {})}
    out = {"steps": args.steps,
           "params": digest(_cpu(model.state_dict())),
           "optimizer": digest(_cpu(optimizer.state_dict()["state"])),
           "rng": digest(rng)}
    for key, value in extra.items():
        out[key] = value if isinstance(value, (int, float, str, bool, list)) or value is None else digest(_cpu(value))
    with open(args.result + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(args.result + ".tmp", args.result)
