"""A deterministic char-level GPT trainer (about 85 M parameters, bf16 autocast) for the GPU drill.

No checkpoint code for snapshots: snapguard snapshots the live process. It writes one line per step
to --log (opened O_APPEND, which CRIU does not size-check at restore):
    step <n> <loss as float32 hex> <unix time> <reserved bytes>
and at the end SHA-256 digests of parameters, optimizer state and RNG state to --result. Data is
generated in-process from the step number, so a run depends on nothing but its seed.
--save-at/--save-path and --resume give the file-checkpoint baseline (torch.save + fsync + rename).
--save-dir DIR: file checkpoints of the same content (so --resume of one is bit-identical) into
DIR/ckpt-<step, 9 digits>.pt (tmp + fsync + rename + directory fsync), keeping the newest --keep N
(default 3; the file just written always stays), each logged as
    saved <step> <seconds the save held training> <unix time it began> <periodic|urgent>
after the step it holds: every --save-every SECONDS of wall time since the end of the last save
(0: none; --urgent-keeps-period counts only from periodic saves), and an urgent one after the step
during which SIGUSR1 arrived (the handler only sets a flag; with --save-dir, SIGUSR1 is always
caught from argument parsing on). The period starts as the first step of each run starts.
--dcp-at/--dcp-path: the other file-checkpoint peer, torch.distributed.checkpoint.async_save into a
directory after that step (no process group: one process); it logs `dcp-staged <step> <seconds the
call held training> <unix time>` when training goes on, then `dcp-done <step> <seconds from the call
to the write complete> <unix time>` (or `dcp-failed <step> <error>`) at the first step boundary after.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import signal
import struct
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# SIGUSR1 asks for an urgent file checkpoint (--save-dir). Counted from the very start: importing
# torch takes seconds, and a signal then would otherwise end the process (its default action)
_URGENT = [0]
signal.signal(signal.SIGUSR1, lambda *_: _URGENT.__setitem__(0, _URGENT[0] + 1))
# SIGUSR2 (a diagnostic of bench/gpu/share_probe.py): after the step, move every parameter, gradient,
# buffer and optimizer state into fresh device allocations, the values unchanged
_RELOCATE = [0]
signal.signal(signal.SIGUSR2, lambda *_: _RELOCATE.__setitem__(0, _RELOCATE[0] + 1))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB, CTX = 256, 256


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.register_buffer("mask", torch.tril(torch.ones(CTX, CTX, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        # explicit attention: deterministic under torch.use_deterministic_algorithms
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, d: int = 768, layers: int = 12, heads: int = 12) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(CTX, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def batch(step: int, size: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Text-like bytes from the step number alone: a seeded walk over a small alphabet."""
    g = torch.Generator(device="cpu").manual_seed(1_000_003 * step + 7)
    base = torch.randint(97, 123, (size, 1), generator=g)
    steps = torch.randint(0, 3, (size, CTX + 1), generator=g)
    seq = ((base + steps.cumsum(1) - 97) % 26 + 97).to(device)
    return seq[:, :-1], seq[:, 1:]


def digest(obj: object) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def rng_states(device: str) -> dict[str, torch.Tensor]:
    return {"rng": torch.get_rng_state(), **({"cuda_rng": torch.cuda.get_rng_state()} if device == "cuda" else {})}


def state_digests(model: nn.Module, opt: torch.optim.Optimizer, device: str) -> dict[str, str]:
    cpu = lambda t: t.detach().cpu()  # noqa: E731
    return {
        "params": digest({k: cpu(v) for k, v in model.state_dict().items()}),
        "optimizer": digest({k: {n: cpu(t) if torch.is_tensor(t) else t for n, t in s.items()}
                             for k, s in opt.state_dict()["state"].items()}),
        "rng": digest(rng_states(device)),
    }


def save_file_checkpoint(path: str, step: int, model: nn.Module, opt: torch.optim.Optimizer, device: str) -> float:
    t0 = time.perf_counter()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict(), **rng_states(device)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return time.perf_counter() - t0


def save_dir_checkpoint(ckdir: str, keep: int, step: int, model: nn.Module, opt: torch.optim.Optimizer,
                        device: str) -> float:
    """save_file_checkpoint into ckdir, the directory fsynced after the rename, then all but the newest
    `keep` files (by step; never the one just written) removed; the seconds it all took."""
    t0 = time.perf_counter()
    name = f"ckpt-{step:09d}.pt"
    save_file_checkpoint(os.path.join(ckdir, name), step, model, opt, device)
    fd = os.open(ckdir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    files = sorted((int(n[5:-3]), n) for n in os.listdir(ckdir)
                   if n.startswith("ckpt-") and n.endswith(".pt") and n[5:-3].isdigit() and n != name)
    for _, old in files[:max(len(files) - (max(keep, 1) - 1), 0)]:
        try:
            os.unlink(os.path.join(ckdir, old))
        except FileNotFoundError:
            pass
    return time.perf_counter() - t0


def dcp_async_save(path: str, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[object, float, list[float]]:
    """Start a DCP async save; (its future, seconds the call held training, [completion time] once done)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    done: list[float] = []
    t0 = time.perf_counter()
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    try:
        ret = dcp.async_save(state, checkpoint_id=path)
    except (RuntimeError, ValueError, AssertionError):
        if dist.is_initialized():
            raise
        # a torch whose async_save wants a process group: one process, gloo, through a file store
        dist.init_process_group("gloo", store=dist.FileStore(path.rstrip("/") + ".pg-store", 1), rank=0, world_size=1)
        ret = dcp.async_save(state, checkpoint_id=path)
    fut = getattr(ret, "upload_completion", ret)  # AsyncSaveResponse (async staging) or a Future
    held = time.perf_counter() - t0
    fut.add_done_callback(lambda _: done.append(time.perf_counter() - t0))
    return fut, held, done


def relocate_device_memory(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    """Each device storage of the model and optimizer through host memory into a new allocation, the
    caching allocator's freed segments given back in between, so none of the new ones reuses an old
    mapping; returns the seconds it took. Views stay valid: a storage is resized, not replaced."""
    t0 = time.time()
    tensors = [*model.parameters(), *model.buffers(),
               *(p.grad for p in model.parameters() if p.grad is not None),
               *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors if t.is_cuda}
    host = {k: s.cpu() for k, s in storages.items()}
    for s in storages.values():
        s.resize_(0)
    torch.cuda.empty_cache()
    for k, s in storages.items():
        s.resize_(host[k].nbytes())
        s.copy_(host[k])
    torch.cuda.synchronize()
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--log", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu runs the drill's machinery where there is no GPU (with a small --width/--layers)")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--save-at", type=int, default=0, help="write a file checkpoint after this step")
    ap.add_argument("--save-path")
    ap.add_argument("--resume", help="continue from a file checkpoint")
    ap.add_argument("--dcp-at", type=int, default=0, help="start a DCP async_save after this step")
    ap.add_argument("--dcp-path", help="the DCP checkpoint directory")
    ap.add_argument("--save-dir", help="periodic (--save-every) and urgent (SIGUSR1) file checkpoints go here")
    ap.add_argument("--save-every", type=float, default=0.0,
                    help="with --save-dir: a file checkpoint after the step that ends SECONDS after the last one")
    ap.add_argument("--keep", type=int, default=3, help="with --save-dir: keep the newest N files (default 3)")
    ap.add_argument("--urgent-keeps-period", action="store_true",
                    help="an urgent save does not restart the --save-every period")
    ap.add_argument("--stderr", help="append stderr to this file (in a container whose stdio is /dev/null)")
    args = ap.parse_args()
    if args.stderr:
        os.dup2(os.open(args.stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), 2)
    asked = _URGENT  # SIGUSR1s so far; a save after the step when it moved
    if args.save_dir:
        os.makedirs(args.save_dir, mode=0o700, exist_ok=True)
    else:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # no files to write: the default, as before
    t_start = time.time()
    torch.manual_seed(1234)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = args.device
    model = GPT(d=args.width, layers=args.layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    fwd = torch.compile(model) if args.compile else model
    first = 1
    if args.resume:
        ck = torch.load(args.resume, map_location=device, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        torch.set_rng_state(ck["rng"].cpu())  # map_location moved the RNG states to the GPU too
        if device == "cuda":
            torch.cuda.set_rng_state(ck["cuda_rng"].cpu())
        first = ck["step"] + 1
    log = open(args.log, "a", buffering=1)
    log.write(f"start {os.getpid()} {t_start:.6f} {time.time():.6f} "
              f"{sum(p.numel() for p in model.parameters())}\n")
    dcp_pending = None
    due = time.time() + args.save_every if args.save_dir and args.save_every > 0 else math.inf
    answered = relocated = 0
    for step in range(first, args.steps + 1):
        x, y = batch(step, args.batch, device)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = F.cross_entropy(fwd(x).float().view(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bits = struct.pack(">f", loss.item()).hex()
        reserved = torch.cuda.memory_reserved() if device == "cuda" else 0
        log.write(f"step {step} {bits} {time.time():.6f} {reserved}\n")
        if step == args.save_at and args.save_path:
            log.write(f"saved {step} {save_file_checkpoint(args.save_path, step, model, opt, device):.6f}\n")
        if args.save_dir:
            now, n = time.time(), asked[0]
            if n != answered or now >= due:
                kind = "urgent" if n != answered else "periodic"
                answered = n  # one arriving during the save asks for another
                stall = save_dir_checkpoint(args.save_dir, args.keep, step, model, opt, device)
                log.write(f"saved {step} {stall:.6f} {now:.6f} {kind}\n")
                if due != math.inf and (kind == "periodic" or not args.urgent_keeps_period):
                    due = time.time() + args.save_every
        if _RELOCATE[0] != relocated and device == "cuda":
            relocated = _RELOCATE[0]
            log.write(f"relocated {step} {relocate_device_memory(model, opt):.6f}\n")
        if dcp_pending is not None and dcp_pending[0].done():
            dcp_report(log, dcp_pending)
            dcp_pending = None
        if step == args.dcp_at and args.dcp_path:
            try:
                fut, held, done = dcp_async_save(args.dcp_path, step, model, opt)
            except Exception as e:  # reported in the log; training goes on
                log.write(f"dcp-failed {step} {' '.join(f'{type(e).__name__}: {e}'.split())[:400]}\n")
            else:
                log.write(f"dcp-staged {step} {held:.6f} {time.time():.6f}\n")
                dcp_pending = (fut, step, done)
    if dcp_pending is not None:
        dcp_pending[0].exception()  # waits for the write
        dcp_report(log, dcp_pending)
    with open(args.result + ".tmp", "w") as f:
        json.dump({"steps": args.steps, **state_digests(model, opt, device)}, f)
    os.replace(args.result + ".tmp", args.result)


def dcp_report(log: io.TextIOBase, pending: tuple[object, int, list[float]]) -> None:
    fut, step, done = pending
    err = fut.exception()  # type: ignore[attr-defined]
    for _ in range(1000):  # done() turns true just before the callbacks run
        if done:
            break
        time.sleep(0.001)
    if err is not None:
        log.write(f"dcp-failed {step} {' '.join(f'{type(err).__name__}: {err}'.split())[:400]}\n")
    else:
        log.write(f"dcp-done {step} {done[0] if done else float('nan'):.6f} {time.time():.6f}\n")


if __name__ == "__main__":
    main()
