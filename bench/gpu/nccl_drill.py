"""A torchrun job of DDP (NCCL on the GPU, gloo on the CPU) snapshotted through snapguard, and the
per-rank benchmark against torch.distributed.checkpoint.async_save of the same job.

`nccl_drill.py drive OUT [--backend nccl --device cuda --nproc-per-node 1]` runs the arms, each a
fresh torchrun job (every launch keeps NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1, except the one arm that turns NVLS on to be refused):
  reference     uninterrupted, no take point: loss bits per step and final digests
  leave-running snapshot through snapguard (checkpoint_pid, leave_running), compared bit for bit
  stop-restore  stop snapshot, restore_images, compared bit for bit
  dcp           the same job calling torch.distributed.checkpoint.async_save at one step (its stall
                and its time to persisted), then a new job loading it (load and cold start)
  refuse-nvls   NCCL_NVLS_ENABLE=1 in the job's environment: expects NCCL_NVLS_ON
  refuse-graph  an all_reduce captured in a CUDA graph (cuda only): expects COLLECTIVE_IN_CUDA_GRAPH
  refuse-raw    a ProcessGroup made directly with the C++ API over a store the trainer made:
                expects PROCESS_GROUP_UNREACHED
A refusal where a snapshot was expected is recorded as that arm's result. Writes OUT/drill.json and
OUT/drill.txt (the table). The page cache is warm (images just written, nothing dropped): stated
in the JSON with the host's Cached figure.

`nccl_drill.py train ...` is one rank (run by torchrun): rank r appends `step N LOSSHEX UNIXTIME`
to OUT/rank<r>.log and writes digests of its parameters, optimizer and RNG to rank<r>.result.json.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

NO_NVLS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ----------------------------------------------------------------------------- one rank

def _digest(obj: object) -> str:
    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def train(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nccl_drill.py train")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--mode", default="plain", choices=("plain", "graph", "raw"))
    ap.add_argument("--dcp-dir", help="async_save the job's state here at --dcp-step")
    ap.add_argument("--dcp-step", type=int, default=20)
    ap.add_argument("--load-dir", help="load the job's state from here (saved at --dcp-step) and go on")
    a = ap.parse_args(argv)
    t_start = time.time()
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = f"cuda:{local % torch.cuda.device_count()}" if a.device == "cuda" else "cpu"
    if device != "cpu":
        torch.cuda.set_device(device)
    dist.init_process_group(a.backend, init_method="env://")
    raw = None
    if a.mode == "raw":  # a group the hook cannot reach: made with the C++ API over the trainer's own store
        c10d = torch._C._distributed_c10d
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world,
                              rank == 0, use_libuv=False)
        if a.backend == "nccl":
            raw = c10d.ProcessGroupNCCL(c10d.PrefixStore("raw", store), rank, world, c10d.ProcessGroupNCCL.Options())
        else:
            from datetime import timedelta
            raw = c10d.ProcessGroupGloo(c10d.PrefixStore("raw", store), rank, world, timedelta(seconds=300))
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model = nn.Sequential(nn.Linear(64, a.width), nn.Tanh(), nn.Linear(a.width, a.width), nn.Tanh(),
                          nn.Linear(a.width, 10)).to(device)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    first = 1
    info: dict = {"rank": rank, "t_start": t_start}
    if a.load_dir:  # DCP restore: load the state saved at --dcp-step and go on from the next step
        import torch.distributed.checkpoint as dcp
        t0 = time.time()
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        msd, osd = get_state_dict(ddp, opt)
        state = {"model": msd, "opt": osd}
        dcp.load(state, checkpoint_id=a.load_dir)
        set_state_dict(ddp, opt, model_state_dict=state["model"], optim_state_dict=state["opt"])
        info["load_s"] = time.time() - t0
        first = a.dcp_step + 1
    if a.mode == "graph" and device != "cpu":  # an NCCL collective captured in a CUDA graph
        buf = torch.ones(1024, device=device)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dist.all_reduce(buf)
        graph.replay()
        torch.cuda.synchronize()
    extra = torch.zeros(4, device=device)
    future = None
    log = open(os.path.join(a.out, f"rank{rank}.log"), "a", buffering=1)
    for step in range(first, a.steps + 1):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(32, 64, generator=g).to(device)
        y = torch.randint(0, 10, (32,), generator=g).to(device)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        extra.fill_(float(step))
        dist.all_reduce(extra)  # an explicit collective every step besides DDP's
        if raw is not None:
            raw.allreduce([extra]).wait()
        now = time.time()
        log.write(f"step {step} {struct.pack('>f', loss.item()).hex()} {now:.6f}\n")
        if a.load_dir and step == first:
            info["first_step_after_start_s"] = now - t_start
        if a.dcp_dir and step == a.dcp_step:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict
            t0 = time.time()
            msd, osd = get_state_dict(ddp, opt)
            future = dcp.async_save({"model": msd, "opt": osd}, checkpoint_id=a.dcp_dir)
            info["async_save_stall_s"] = time.time() - t0
            info["t_save"] = t0
        if future is not None and "persisted_s" not in info and future.done():
            future.result()
            info["persisted_s"] = time.time() - info["t_save"]
        time.sleep(a.step_sleep)
    if future is not None and "persisted_s" not in info:
        future.result()
        info["persisted_s"] = time.time() - info["t_save"]
    dist.barrier()
    result = {"params": _digest({k: v.cpu() for k, v in model.state_dict().items()}),
              "optimizer": _digest({k: {n: t.cpu() if torch.is_tensor(t) else t for n, t in s.items()}
                                    for k, s in opt.state_dict()["state"].items()}),
              "rng": _digest(torch.get_rng_state())}
    path = os.path.join(a.out, f"rank{rank}.result.json")
    Path(path + ".tmp").write_text(json.dumps(result))
    os.replace(path + ".tmp", path)
    Path(os.path.join(a.out, f"rank{rank}.info.json")).write_text(json.dumps(info))
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------- the driver

def launch(argv: list[str]) -> int:
    """`launch WORLD PORT train ...`: the ranks as torchrun sets them (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) under this plain parent, without torchrun's agent and its store."""
    world, port, rest = int(argv[0]), argv[1], argv[2:]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *rest],
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                              stdin=subprocess.DEVNULL) for r in range(world)]
    return max(p.wait() for p in procs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One torchrun launch of `train`, its ranks' logs under `out`."""

    def __init__(self, out: Path, a: argparse.Namespace, *, hook: bool, env: dict | None = None,
                 extra: list[str] | None = None) -> None:
        self.out, self.a, self.hook, self.env, self.extra = out, a, hook, env or {}, extra or []
        self.world = a.nproc_per_node
        self.restored = False  # restored by CRIU: the tree is no longer this process's child

    def start(self) -> subprocess.Popen:
        self.out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **NO_NVLS, "PYTHONWARNINGS": "ignore", "USE_LIBUV": "0", "UV_USE_IO_URING": "0",
               "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **self.env}
        if self.hook:
            from snapguard.config import load
            from snapguard.takepoint import site_dir
            from snapguard_lab.testbed import product_root
            env["PYTHONPATH"] = os.pathsep.join([site_dir(), product_root()])
            env["SNAPGUARD_TAKE_DIR"] = f"{load().state_dir}/take"
        port = _free_port()
        if self.a.launcher == "torchrun":
            nproc = getattr(self.a, "nproc_arg", None) or str(self.world)  # gpu|auto: torchrun counts
            head = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", nproc,
                    "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port),
                    "--node-rank", "0", os.path.abspath(__file__)]
        else:  # one process per rank under a plain parent, env:// as torchrun's ranks see it, no agent
            head = [sys.executable, os.path.abspath(__file__), "launch", str(self.world), str(port)]
        cmd = [*head, "train", "--out", str(self.out),
               "--steps", str(self.a.steps), "--backend", self.a.backend, "--device", self.a.device,
               "--width", str(self.a.width), *self.extra]
        log = open(self.out / "torchrun.out", "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     start_new_session=True)
        log.close()
        return self.proc

    def rows(self, rank: int) -> list[tuple[int, str, float]]:
        try:
            lines = (self.out / f"rank{rank}.log").read_text().splitlines()
        except FileNotFoundError:
            return []
        return [(int(s), b, float(t)) for _, s, b, t in (ln.split() for ln in lines if ln.count(" ") == 3)]

    def wait_step(self, step: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(max((s for s, _, _ in self.rows(r)), default=0) >= step for r in range(self.world)):
                return
            if not self.restored and self.proc.poll() is not None:
                raise RuntimeError(f"job exited {self.proc.returncode} before step {step}: {self.tail()}")
            time.sleep(0.02)
        raise TimeoutError(f"job did not reach step {step}: {self.tail()}")

    def results(self, timeout: float = 240) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            paths = [self.out / f"rank{r}.result.json" for r in range(self.world)]
            if all(p.exists() for p in paths):
                return [json.loads(p.read_text()) for p in paths]
            time.sleep(0.05)
        raise TimeoutError(f"job did not finish: {self.tail()}")

    def infos(self) -> list[dict]:
        return [json.loads((self.out / f"rank{r}.info.json").read_text()) for r in range(self.world)]

    def tail(self) -> str:
        try:
            return " | ".join((self.out / "torchrun.out").read_text().splitlines()[-4:])[-600:]
        except FileNotFoundError:
            return ""

    def mismatches(self, ref: Job) -> list[str]:
        errors = [] if self.results() == ref.results() else ["final digests differ"]
        for r in range(self.world):
            want: dict[int, set] = {}
            for s, b, _ in ref.rows(r):
                want.setdefault(s, set()).add(b)
            got: dict[int, set] = {}
            for s, b, _ in self.rows(r):
                got.setdefault(s, set()).add(b)
            if set(got) != set(want):
                errors.append(f"rank {r}: steps {sorted(set(want) ^ set(got))[:5]} differ")
            errors += [f"rank {r} step {s}: {sorted(b)} != {sorted(want.get(s, []))}"
                       for s, b in sorted(got.items()) if b != want.get(s)][:5]
        return errors

    def kill(self) -> None:
        if getattr(self, "proc", None) is not None:
            subprocess.run(["pkill", "-9", "-s", str(self.proc.pid)], check=False)


def _gaps(job: Job, rank: int) -> tuple[float, float]:
    """(the longest gap between two logged steps, the median gap): the stall is the first less the second."""
    ts = [t for _, _, t in job.rows(rank)]
    gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
    return (gaps[-1], gaps[len(gaps) // 2]) if gaps else (0.0, 0.0)


def _refusal(e: BaseException) -> dict:
    reason = getattr(e, "reason", None)
    return {"refused": True, "reason": getattr(reason, "name", None), "detail": str(e)[:400]}


def _snapshot_arm(a: argparse.Namespace, base: Path, ref: Job, name: str, leave_running: bool) -> dict:
    from snapguard.config import load
    from snapguard.pipeline import checkpoint_pid, restore_images
    from snapguard.preflight import pid_report
    config = load()
    job = Job(base / name, a, hook=True)
    job.start()
    arm: dict = {}
    try:
        job.wait_step(a.at)
        pre = pid_report(job.proc.pid, config)
        arm["preflight"] = {"verdict": pre.verdict, "blockers": [b.to_dict() for b in pre.blockers]}
        images = str(base / f"{name}.img")
        try:
            ck = checkpoint_pid(job.proc.pid, images, config, leave_running=leave_running)
        except Exception as e:
            arm.update(_refusal(e))
            return arm
        arm.update(take_point=ck.get("take_point"), cuda_pids=ck.get("cuda_pids"), image_bytes=ck.get("image_bytes"),
                   image_bytes_per_rank=(ck.get("image_bytes") or 0) / job.world, checkpoint=ck.get("timings"))
        if not leave_running:
            job.proc.wait(timeout=120)
            t0 = time.time()
            job.restored = True
            rs = restore_images(images, config)
            arm["restore"] = rs.get("timings")
            job.wait_step(a.steps)
            arm["restore_to_first_step_s"] = [min((t for _, _, t in job.rows(r) if t > t0), default=None) - t0
                                              for r in range(job.world)]
        else:
            job.proc.wait(timeout=300)
        arm["stall_s"] = [round(g - m, 4) for g, m in (_gaps(job, r) for r in range(job.world))]
        arm["mismatches"] = job.mismatches(ref)
        arm["bit_identical"] = not arm["mismatches"]
    except Exception as e:
        arm["error"] = f"{type(e).__name__}: {e}"[:600]
    finally:
        job.kill()
    return arm


def _refuse_arm(a: argparse.Namespace, base: Path, name: str, want: str, env: dict, extra: list[str]) -> dict:
    from snapguard.config import load
    from snapguard.pipeline import checkpoint_pid
    from snapguard.preflight import pid_report
    config = load()
    job = Job(base / name, a, hook=True, env=env, extra=extra)
    job.start()
    arm: dict = {"expect": want}
    try:
        job.wait_step(a.at)
        pre = pid_report(job.proc.pid, config)
        arm["preflight"] = {"verdict": pre.verdict, "reasons": sorted({b.to_dict()["reason"] for b in pre.blockers})}
        try:
            checkpoint_pid(job.proc.pid, str(base / f"{name}.img"), config, leave_running=True)
            arm["refused"] = False
        except Exception as e:
            arm.update(_refusal(e))
        n = max(s for s, _, _ in job.rows(0))
        job.wait_step(n + 3)
        arm["still_training"] = True
        arm["ok"] = arm.get("reason") == want
    except Exception as e:
        arm["error"] = f"{type(e).__name__}: {e}"[:600]
        arm["ok"] = False
    finally:
        job.kill()
    return arm


def _dcp_arm(a: argparse.Namespace, base: Path, ref: Job) -> dict:
    # async_save needs a CPU backend in the default group: the job runs on "cpu:gloo,cuda:nccl"
    a = argparse.Namespace(**{**vars(a), "backend": "cpu:gloo,cuda:nccl" if a.backend == "nccl" else a.backend})
    ckpt = base / "dcp-ckpt"
    save = Job(base / "dcp-save", a, hook=False, extra=["--dcp-dir", str(ckpt), "--dcp-step", str(a.at)])
    save.start()
    arm: dict = {}
    try:
        save.proc.wait(timeout=300)
        infos = save.infos()
        arm["async_save_stall_s"] = [i["async_save_stall_s"] for i in infos]
        arm["persisted_s"] = [i["persisted_s"] for i in infos]
        arm["ckpt_bytes"] = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        arm["ckpt_bytes_per_rank"] = arm["ckpt_bytes"] / save.world
        arm["save_run_bit_identical"] = not save.mismatches(ref)
        load = Job(base / "dcp-load", a, hook=False, extra=["--load-dir", str(ckpt), "--dcp-step", str(a.at)])
        t0 = time.time()
        load.start()
        load.proc.wait(timeout=300)
        li = load.infos()
        arm["load_s"] = [i["load_s"] for i in li]
        arm["cold_start_to_first_step_s"] = [min(t for s, _, t in load.rows(i["rank"])) - t0 for i in li]
        # the resumed run logs steps at+1.. only: compare those with the reference
        want = {r: {s: b for s, b, _ in ref.rows(r)} for r in range(load.world)}
        arm["resumed_mismatches"] = [f"rank {r} step {s}" for r in range(load.world) for s, b, _ in load.rows(r)
                                     if want[r].get(s) != b][:5]
        arm["resumed_digests_equal"] = load.results() == ref.results()
    except Exception as e:
        arm["error"] = f"{type(e).__name__}: {e}"[:600]
        arm["log_tail"] = [ln for ln in (save.out / "torchrun.out").read_text().splitlines()
                           if "Error" in ln or "error" in ln][-6:]
    finally:
        save.kill()
    return arm


def _table(report: dict) -> str:
    rows = ["| arm | result | stall s (per rank) | image / ckpt bytes per rank | restore->first step s |",
            "|---|---|---|---|---|"]
    for name, arm in report["arms"].items():
        if name.startswith("refuse"):
            res = f"{'OK' if arm.get('ok') else 'UNEXPECTED'}: {arm.get('reason')} (want {arm['expect']})"
            rows.append(f"| {name} | {res} | | | |")
        elif name == "dcp":
            rows.append(f"| dcp async_save | persisted {arm.get('persisted_s')} s | {arm.get('async_save_stall_s')} | "
                        f"{arm.get('ckpt_bytes_per_rank')} | load {arm.get('load_s')} cold {arm.get('cold_start_to_first_step_s')} |")
        elif name != "reference":
            res = (f"refused {arm.get('reason')}" if arm.get("refused") else
                   "bit-identical" if arm.get("bit_identical") else arm.get("error") or arm.get("mismatches"))
            rows.append(f"| {name} | {res} | {arm.get('stall_s')} | {arm.get('image_bytes_per_rank')} | "
                        f"{arm.get('restore_to_first_step_s', '')} |")
    return "\n".join(rows) + "\n"


def drive(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nccl_drill.py drive")
    ap.add_argument("out")
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--nproc-per-node", type=int, default=1)
    ap.add_argument("--nproc-arg", choices=("gpu", "auto"),
                    help="give torchrun this as --nproc-per-node (it must count --nproc-per-node GPUs)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--at", type=int, default=20, help="the step the snapshot (and async_save) is taken near")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--launcher", default="torchrun", choices=("torchrun", "env"),
                    help="torchrun (its elastic agent is the tree's root) or env (a plain parent, env:// ranks)")
    ap.add_argument("--arms", default="leave-running,stop-restore,dcp,refuse-nvls,refuse-graph,refuse-raw")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = Path(f"/tmp/nccl-drill-{int(time.time())}")
    import torch
    report: dict = {"launcher": a.launcher, "backend": a.backend, "device": a.device, "world": a.nproc_per_node, "nproc_arg": a.nproc_arg, "steps": a.steps,
                    "width": a.width, "torch": torch.__version__, "env": NO_NVLS, "arms": {}}
    ref = Job(base / "reference", a, hook=False)
    ref.start()
    rc = ref.proc.wait(timeout=300)
    report["arms"]["reference"] = {"rc": rc, "results": ref.results() if rc == 0 else ref.tail()}
    arms = a.arms.split(",")
    for name in arms:
        t0 = time.time()
        if name in ("leave-running", "stop-restore"):
            arm = _snapshot_arm(a, base, ref, name, name == "leave-running")
        elif name == "dcp":
            arm = _dcp_arm(a, base, ref)
        elif name == "refuse-nvls":
            if a.backend != "nccl":
                continue
            arm = _refuse_arm(a, base, name, "NCCL_NVLS_ON", {"NCCL_NVLS_ENABLE": "1"}, [])
        elif name == "refuse-graph":
            if a.device == "cpu":
                continue
            arm = _refuse_arm(a, base, name, "COLLECTIVE_IN_CUDA_GRAPH", {}, ["--mode", "graph"])
        elif name == "refuse-raw":
            arm = _refuse_arm(a, base, name, "PROCESS_GROUP_UNREACHED", {}, ["--mode", "raw"])
        else:
            raise SystemExit(f"unknown arm {name}")
        arm["wall_s"] = round(time.time() - t0, 2)
        report["arms"][name] = arm
        print(name, json.dumps(arm, default=str)[:1500], flush=True)
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    report["page_cache"] = {"state": "warm: images and DCP files just written, no cache dropped",
                            "meminfo": [ln for ln in meminfo if ln.startswith(("Cached:", "MemFree:"))]}
    (out / "drill.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    table = _table(report)
    (out / "drill.txt").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    verb, rest = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if verb == "train":
        sys.exit(train(rest))
    if verb == "launch":
        sys.exit(launch(rest))
    if verb == "drive":
        sys.exit(drive(rest))
    raise SystemExit(__doc__)
