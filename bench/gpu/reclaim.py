"""Reclaim recovery on the GPU machine: a notice -> the agent's stopping snapshot streamed into an
image store -> `snapguard restore --store` on "another node", bit for bit against an uninterrupted run.

Two nodes on one machine: node A (state /run/sg-a, the agent, its images) and node B (state
/run/sg-b, the pulled image). snapguard's state directory is /run/snapguard, a tmpfs on a systemd
node; where /run is not one (the lent H200 machines: ext4), each node's state directory gets a
tmpfs of its own (--node-fs tmpfs, the default; --node-fs as-is keeps the disk, as the first runs
did), so CRIU's writes and the pulled copy do not share the disk with the store's fsyncs. The store is a file:// directory on the machine's
disk (/root/sg-reclaim/store: off tmpfs, fsynced, as a shared filesystem would be). With two GPUs
the trainer runs on GPU 0 (CUDA_VISIBLE_DEVICES=0) and node B restores it onto GPU 1 through the
device map (`--device-map 0=1`); with one GPU it restores onto the same GPU.

Per run: notice -> image whole in the store (the agent's `uploaded` journal line), notice ->
first new step after the restore, what the restore spent fetching, bytes moved (into the store and
out of it), the GPU the restored trainer runs on (NVML), loss bits at every step and the final
digests against the reference. Runs: `warm` (node B restores straight after the upload: the
store's pages are still in the page cache) and `cold` (caches dropped after the upload; its
notice -> first step is reported as measured, with the drop's own time taken out). In the same
command, the baseline a user has today: the trainer's own file checkpoint (torch.save + fsync)
written on the notice and a start from it, once as the machine is (`file-warm`) and once with the
page cache dropped first (`file-cold`). The target (issue 33, item 5): notice -> first new step at
most 0.7 x the file path's (save on notice + start -> first new step), warm against warm and cold
against cold; the ratios are in the table and the JSON.

    source bench/gpu/setup.sh && python3 bench/gpu/reclaim.py bench/results/h200/reclaim-DATE.json \
        [--size 85m|350m|1.2b|WIDTHxLAYERS]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from snapguard import procfs
from snapguard.config import load
from snapguard.preflight.gpu import gpu_facts
from snapguard_lab.torch_drill import Trainer, compare, file_checkpoint_run

from scaling import SIZES  # bench/gpu/scaling.py, beside this script

BASE = Path("/root/sg-reclaim")
NODE_A = "/run/sg-a"
NODE_B = "/run/sg-b"
RATIO_TARGET = 0.7  # notice -> first new step against the file path's, at most
FILE_ARMS = {"warm": "file-warm", "cold": "file-cold"}  # the snapguard run each file arm is set against


def exe(name: str) -> str:
    for d in (os.path.dirname(sys.executable), "/usr/local/bin"):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    sys.exit(f"reclaim.py: no {name} beside {sys.executable} or in /usr/local/bin")


def timed_cli(profile: Path | None, name: str) -> list[str]:
    """The argv head of a snapguard command on the notice's path: under cProfile when `profile` is a
    directory (its NAME.prof there, read by `python3 -m pstats`), to see where a command's time goes."""
    if profile is None:
        return [exe("snapguard")]
    return [sys.executable, "-m", "cProfile", "-o", str(profile / f"{name}.prof"), exe("snapguard")]


def node_env(state: str) -> dict[str, str]:
    return {**os.environ, "SNAPGUARD_STATE_DIR": state}


def journal(state: str) -> list[dict[str, Any]]:
    try:
        lines = Path(state, "agent", "journal.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(x) for x in lines if x.strip()]


def wait_event(state: str, name: str, timeout: float) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for ev in journal(state):
            if ev["event"] == name:
                return ev
            if ev["event"] in ("snapshot_failed", "upload_failed"):
                raise RuntimeError(f"agent: {ev}")
        time.sleep(0.01)
    raise TimeoutError(f"no {name} in the agent's journal")


def gpu_of(pid: int) -> int | None:
    facts = gpu_facts() or {}
    for g in facts.get("gpus", []):
        if pid in g.get("processes", {}):
            return int(g["index"])
    return None


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, file system type) of the mount `path` is on (snapguard.procfs reads mountinfo:
    the lent machines have no findmnt), ("?", "?") when that cannot be told."""
    m = procfs.mount_of(os.path.realpath(path))
    return (m["mount_point"], m["fstype"]) if m else ("?", "?")


def fstype(path: str) -> str:
    return mount_of(path)[1]


def file_arms(text: str) -> list[str]:
    """--file-arms: a comma-separated list of FILE_ARMS' keys, or none."""
    arms = [k.strip() for k in text.split(",") if k.strip()]
    if unknown := [k for k in arms if k not in FILE_ARMS]:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: warm, cold or both")
    return arms


def parse_size(text: str) -> tuple[str, int, int]:
    """(job name, width, layers) of --size: one of SIZES or WIDTHxLAYERS."""
    if text in SIZES:
        return (f"gpt{text}", *SIZES[text])
    try:
        w, layers = (int(x) for x in text.split("x"))
    except ValueError:
        raise SystemExit(f"reclaim.py: --size {text!r}: one of {', '.join(SIZES)} or WIDTHxLAYERS") from None
    return (f"gpt{w}x{layers}", w, layers)


def clear(d: str) -> None:
    """An empty node state directory, 0700: emptied in place (it may be a mount point)."""
    os.makedirs(d, mode=0o700, exist_ok=True)
    for name in os.listdir(d):
        p = os.path.join(d, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)
    os.chmod(d, 0o700)


def node_tmpfs(mounted: list[str]) -> None:
    """A tmpfs on each node's state directory, unless it is on one already (listed in `mounted`)."""
    for d in (NODE_A, NODE_B):
        os.makedirs(d, mode=0o700, exist_ok=True)
        if fstype(d) != "tmpfs":
            subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=64g", "tmpfs", d], check=True, timeout=30)
            mounted.append(d)


def unmount(d: str, wait_s: float = 10.0) -> None:
    """Unmount a node's tmpfs, given the processes of the last run a few seconds to let go of it."""
    end = time.monotonic() + wait_s
    while True:
        out = subprocess.run(["umount", d], capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            return
        if time.monotonic() > end:
            print(f"reclaim: {d} left mounted: {out.stderr.strip()}", file=sys.stderr)
            return
        time.sleep(0.2)


def drop_caches() -> float:
    t = time.monotonic()
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    return time.monotonic() - t


def one_run(tag: str, base: Path, ref: Trainer, ref_result: dict[str, Any], *, job: str, steps: int, at: int,
            extra: list[str], gpu_env: dict[str, str], remap: bool, cold: bool,
            profile: Path | None = None) -> dict[str, Any]:
    store_dir = base / f"store-{tag}"
    store_url = f"file://{store_dir}"
    for d in (NODE_A, NODE_B):
        clear(d)
    os.makedirs(store_dir, mode=0o700)
    run = Trainer(base, f"reclaim-{tag}", steps, trimmed=True, extra=extra, env=gpu_env)
    pid = run.start(os.path.join(NODE_A, "take"))
    # the agent as a node runs it: its default --interval (5 s); the inbox wakes it as a notice lands
    agent = subprocess.Popen([exe("snapguard"), "agent", "--store", store_url,
                              "--images", os.path.join(NODE_A, "images")], env=node_env(NODE_A),
                             stdin=subprocess.DEVNULL, stdout=open(base / f"agent-{tag}.log", "wb"),
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_event(NODE_A, "agent_started", 60)
        out = subprocess.run([exe("snapguard"), "protect", "--pid", str(pid), "--job", job], env=node_env(NODE_A),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        run.wait_step(at)
        t_notice = time.time()
        out = subprocess.run([*timed_cli(profile, f"notice-{tag}"), "notice", "--reason", f"reclaim drill {tag}", "--lead", "30"],
                             env=node_env(NODE_A), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        uploaded = wait_event(NODE_A, "uploaded", 300)
        events = {e["event"]: e for e in journal(NODE_A)}
        assert run.proc is not None
        run.proc.wait(timeout=60)  # CRIU ended it: reaped, so its pid is free for the restore
        last_before = run.rows()[-1][0]
        dropped = drop_caches() if cold else 0.0
        t_restore = time.time()
        argv = [*timed_cli(profile, f"restore-{tag}"), "restore", "--store", store_url, "--job", job, "--json"]
        if remap:
            argv += ["--device-map", "0=1"]
        rs = subprocess.run(argv, env=node_env(NODE_B), capture_output=True, text=True, timeout=300)
        t_restored = time.time()
        if rs.returncode != 0:
            raise RuntimeError(f"restore --from: exit {rs.returncode}: {rs.stderr.strip()[-2000:]}")
        restored = json.loads(rs.stdout)
        run.restored_pid = restored["pid"]
        first = run.first_step_after(t_restore)
        on_gpu = gpu_of(restored["pid"])
        result = run.wait_done(pid=restored["pid"])
    except BaseException:
        run.kill()
        raise
    finally:
        agent.terminate()
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
    sealed = events["snapshot_sealed"]
    row = {
        "run": tag, "page_cache": "cold (dropped after the upload)" if cold else "warm",
        "remap": "GPU 0 -> GPU 1" if remap else "same GPU", "restored_on_gpu": on_gpu,
        "snapshot_at_step": at, "last_step_before": last_before, "first_new_step": first[0],
        "notice_to_agent_s": events["noticed"]["t"] - t_notice,
        "notice_to_sealed_s": sealed["t"] - t_notice,
        "notice_to_image_whole_s": uploaded["t"] - t_notice,
        "streamed_bytes": uploaded.get("streamed_bytes"), "resent": uploaded.get("resent"),
        "image_bytes": sealed.get("image_bytes"), "snapshot_timings": sealed.get("timings"),
        "dump_marks": sealed.get("criu_marks"),
        "bytes_moved": {"into_store": sealed.get("image_bytes"), "out_of_store": restored["fetch"]["bytes"]},
        "drop_caches_s": dropped,
        "restore_fetch_s": restored["fetch"]["seconds"], "restore_timings": restored["timings"],
        "restore_to_first_new_step_s": first[2] - t_restore, "restore_command_s": t_restored - t_restore,
        "notice_to_first_new_step_s": first[2] - t_notice - dropped,
        "fence_epoch": restored.get("fence_epoch"), "device_map": restored.get("device_map"),
    }
    row.update(compare(ref, run, ref_result, result))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON results path (a .txt beside it gets the table)")
    ap.add_argument("--size", default="85m", help=f"the trainer's GPT: {', '.join(SIZES)} or WIDTHxLAYERS (default 85m)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--at", type=int, default=100)
    ap.add_argument("--runs", default="warm,cold", help="warm, cold or both (default)")
    ap.add_argument("--file-arms", type=file_arms, default="warm,cold",
                    help="the file path's starts: warm, cold, both (default) or none ('')")
    ap.add_argument("--profile", action="store_true",
                    help="run `snapguard notice` and `snapguard restore` under cProfile: NAME.prof beside OUT")
    ap.add_argument("--trainer-args", default="", help="extra train.py arguments (the CPU check: --device cpu ...)")
    ap.add_argument("--drop-grads", action="store_true",
                    help="the trainer's take point drops the stepped optimizer's gradients "
                         "(SNAPGUARD_TAKE_DROP_GRADS=1): train.py sets them to None before every backward")
    ap.add_argument("--node-fs", choices=("tmpfs", "as-is"), default="tmpfs",
                    help="tmpfs (default): a tmpfs on each node's state directory where /run is not one")
    args = ap.parse_args()
    job, width, layers = parse_size(args.size)
    if os.geteuid() != 0:
        sys.exit("reclaim.py: run as root")
    facts = gpu_facts() or {}
    ngpu = len(facts.get("gpus", []))
    remap = ngpu >= 2
    extra = ["--width", str(width), "--layers", str(layers), *args.trainer_args.split()]
    gpu_env = {"CUDA_VISIBLE_DEVICES": "0"} if ngpu else {}
    if args.drop_grads:
        gpu_env["SNAPGUARD_TAKE_DROP_GRADS"] = "1"
    shutil.rmtree(BASE, ignore_errors=True)
    BASE.mkdir(mode=0o700, parents=True)
    load()  # the config is readable before anything starts
    os.makedirs(NODE_A, mode=0o700, exist_ok=True)
    mounted: list[str] = []
    if args.node_fs == "tmpfs":
        node_tmpfs(mounted)
    try:
        return _runs(args, job, facts, ngpu, remap, extra, gpu_env)
    finally:
        for d in mounted:
            unmount(d)


def ratios(rows: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each snapguard run's notice -> first new step against its file arm's (FILE_ARMS)."""
    files = {b["arm"]: b for b in baseline}
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        b = files.get(FILE_ARMS.get(r["run"], ""))
        if r.get("failed") or b is None or not b.get("notice_to_first_new_step_s"):
            continue
        ratio = r["notice_to_first_new_step_s"] / b["notice_to_first_new_step_s"]
        out[r["run"]] = {"against": b["arm"], "snapguard_s": r["notice_to_first_new_step_s"],
                         "file_s": b["notice_to_first_new_step_s"], "ratio": ratio,
                         "target": RATIO_TARGET, "met": ratio <= RATIO_TARGET}
    return out


def _runs(args: argparse.Namespace, job: str, facts: dict[str, Any], ngpu: int, remap: bool, extra: list[str],
          gpu_env: dict[str, str]) -> int:
    print(f"reclaim: {job} ({' '.join(extra)}); node state dirs on {' '.join(mount_of(NODE_A))}; store on "
          f"{' '.join(mount_of(str(BASE)))}", flush=True)
    print(f"reclaim: {ngpu} GPU(s) ({', '.join(g['name'] for g in facts.get('gpus', []))}), driver "
          f"{facts.get('driver_version')}; {'remap GPU 0 -> GPU 1' if remap else 'restore onto the same GPU'}",
          flush=True)
    ref = Trainer(BASE, "reference", args.steps, extra=extra, env=gpu_env)
    ref.start()
    ref_result = ref.wait_done()
    rows: list[dict[str, Any]] = []
    for tag in [t.strip() for t in args.runs.split(",") if t.strip()]:
        try:
            row = one_run(tag, BASE, ref, ref_result, job=job, steps=args.steps, at=args.at, extra=extra,
                          gpu_env=gpu_env, remap=remap, cold=(tag == "cold"),
                          profile=Path(args.out).resolve().parent if args.profile else None)
        except (RuntimeError, TimeoutError, AssertionError, OSError, subprocess.SubprocessError) as e:
            row = {"run": tag, "failed": True, "error": f"{type(e).__name__}: {e}"[-3000:]}
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    # the file path a user has today: saved on the notice, then a start from it, the page cache as
    # the machine has it and then dropped (the drop's own time kept apart, as the cold run's is)
    baseline = file_checkpoint_run(BASE, ref, ref_result, steps=args.steps, at=args.at, extra=tuple(extra),
                                   save_env=gpu_env, resumes={FILE_ARMS[k]: gpu_env for k in args.file_arms},
                                   before_resume=lambda arm: drop_caches() if arm == FILE_ARMS["cold"] else 0.0
                                   ) if args.file_arms else []
    stall = next((b["stall_s"] for b in baseline if "stall_s" in b), 0.0)
    for b in baseline:
        b["page_cache"] = "cold (dropped before the start)" if b["arm"] == FILE_ARMS["cold"] else "warm"
        b["save_on_notice_s"] = stall
        b["notice_to_first_new_step_s"] = stall + (b.get("resume_to_first_new_step_s") or 0.0)
        print(json.dumps(b, default=str), flush=True)
    vs = ratios(rows, baseline)
    lines = [f"{'run':<12}{'notice->whole s':>16}{'notice->step s':>16}{'restore->step s':>17}{'fetch s':>9}"
             f"{'image GB':>10}{'streamed GB':>13}{'GPU':>5}{'vs file':>9}  bit-identical"]
    for r in rows:
        if r.get("failed"):
            lines.append(f"{r['run']:<12}FAILED: {r['error'][:200]}")
            continue
        ratio = f"{vs[r['run']]['ratio']:.2f}x" if r["run"] in vs else "-"
        lines.append(f"{r['run']:<12}{r['notice_to_image_whole_s']:>16.2f}{r['notice_to_first_new_step_s']:>16.2f}"
                     f"{r['restore_to_first_new_step_s']:>17.2f}{r['restore_fetch_s']:>9.2f}"
                     f"{(r['image_bytes'] or 0) / 1e9:>10.2f}{(r['streamed_bytes'] or 0) / 1e9:>13.2f}"
                     f"{str(r['restored_on_gpu']):>5}{ratio:>9}  {'yes' if r['bit_identical'] else 'NO'}")
    for b in baseline:
        lines.append(f"{b['arm']:<12}{stall:>16.2f}{b['notice_to_first_new_step_s']:>16.2f}"
                     f"{b.get('resume_to_first_new_step_s', 0):>17.2f}{'':>9}{b.get('image_bytes', 0) / 1e9:>10.2f}"
                     f"{'':>13}{'':>5}{'':>9}  {'yes' if b.get('bit_identical') else 'NO'}")
    lines.append(f"target: notice -> first new step <= {RATIO_TARGET} x the file path's (warm vs file-warm, "
                 "cold vs file-cold): " + ("; ".join(f"{k} {v['ratio']:.2f}x {'met' if v['met'] else 'NOT met'}"
                                                     for k, v in vs.items()) or "no pair measured"))
    table = "\n".join(lines)
    print(table)
    ok = all(r.get("bit_identical") for r in rows + baseline)
    doc = {"ok": ok, "date": time.strftime("%Y-%m-%d"), "gpus": ngpu, "driver": facts.get("driver_version"),
           "job": job, "trainer_args": extra, "steps": args.steps, "at": args.at,
           "store": "file:// on the machine's disk, fsynced",
           "node_state_fs": {d: fstype(d) for d in (NODE_A, NODE_B)}, "drop_grads": args.drop_grads,
           "runs": rows, "baseline": baseline, "vs_file": vs,
           "targets": {"notice_to_image_whole_s": 8.0, "notice_to_first_new_step_s": 12.0,
                       "notice_to_first_new_step_vs_file": RATIO_TARGET}}
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    Path(args.out).with_suffix(".txt").write_text(table + "\n")
    print("reclaim: PASS" if ok else "reclaim: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
