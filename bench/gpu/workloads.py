"""Issue 15 on the H200: which trainers snapshot. The workload matrix (lab/snapguard_lab/matrix.py,
the scripts of lab/snapguard_lab/workloads/matrix), each row through snapguard's pipeline
leave-running and stop + restore (page cache dropped before the restore), bit-exact against an
uninterrupted run of the same workload, with stall, image size and restore to first step:

  plain                    a plain PyTorch loop
  dataloader               DataLoader, 4 forked workers, pin_memory, persistent_workers
  compile                  torch.compile, default mode and worker pool (a recompile after the snapshot
                           brings the pool back)
  compile-reduce-overhead  torch.compile mode="reduce-overhead" (CUDA graphs)
  amp                      fp16 autocast + GradScaler
  hf-trainer               a Hugging Face Trainer, GPT-2 built from its config
  lightning                a PyTorch Lightning Trainer
  accumulation             4 micro-batches per optimizer step, the snapshot asked mid-accumulation

Before the rows, two checks of what the take point resolves (skipped with --no-checks):
  fork-child   a CUDA process forks a child with the hook: the child holds no /dev/nvidia* handle,
               touching CUDA there raises PyTorch's own error, and it exits 0; the same without the
               resolution (SNAPGUARD_RESOLVE_BLOCKERS=0) keeps the handles
  refusals     the dataloader trainer with the hook's resolution off, and the compiled trainer
               without the hook: each snapshot refused before anything is frozen (typed, pids named),
               the trainer finishing its steps

Every row and check records its own failure and the next one runs. Prints a table; writes
OUT_DIR/workloads.json (rewritten after every row), OUT_DIR/workloads.txt (the table) and
OUT_DIR/logs/<row>/ (each run's step log and output, CRIU's logs of an arm that failed). Images and
working files go to --workdir (default: a new directory in /var/tmp, removed at the end unless
--keep). Rows that would end past --budget-s are skipped, each with the command that runs it.

    source bench/gpu/setup.sh && python3 bench/gpu/workloads.py OUT_DIR
    python3 bench/gpu/workloads.py OUT_DIR --rows lightning,accumulation --no-checks
    python3 bench/gpu/workloads.py OUT_DIR --device cpu     # the machinery on a machine with no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from snapguard.config import load
from snapguard.takepoint import RESOLVE_ENV, site_dir
from snapguard_lab.matrix import ROWS, refusal_check, run_matrix, table
from snapguard_lab.testbed import product_root

FORK_CHILD = r"""
import json, os, sys, torch
x = torch.ones(1 << 20, device="cuda")
torch.cuda.synchronize()


def held():
    fds = []
    for n in os.listdir("/proc/self/fd"):
        try:
            t = os.readlink(f"/proc/self/fd/{n}")
        except OSError:
            continue
        if t.startswith("/dev/nvidia"):
            fds.append(t)
    maps = set()
    for line in open("/proc/self/maps"):
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/dev/nvidia"):
            maps.add(parts[5].strip())
    return {"fds": sorted(fds), "maps": sorted(maps)}


parent = held()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    report = {"handles": held(), "is_available": torch.cuda.is_available()}
    try:
        torch.ones(1, device="cuda")
        report["cuda"] = "worked"
    except Exception as e:  # PyTorch's own: Cannot re-initialize CUDA in forked subprocess
        report["cuda"] = f"{type(e).__name__}: {e}"[:300]
    os.write(w, json.dumps(report).encode())
    os.close(w)
    sys.exit(0)  # a normal exit: atexit handlers and the libraries' destructors run
os.close(w)
data = b""
while chunk := os.read(r, 65536):
    data += chunk
_, status = os.waitpid(pid, 0)
print(json.dumps({"parent": parent, "child": json.loads(data or b"{}"),
                  "child_exit": os.waitstatus_to_exitcode(status)}))
"""


def fork_child_check(take_dir: str) -> list[dict[str, Any]]:
    """The fork handler on the real driver: with the hook, and with its resolution off."""
    out = []
    for resolve in (True, False):
        env = {k: v for k, v in os.environ.items() if k != RESOLVE_ENV}
        env.update(PYTHONPATH=os.pathsep.join(filter(None, [site_dir(), product_root(), env.get("PYTHONPATH")])),
                   SNAPGUARD_TAKE_DIR=take_dir)
        if not resolve:
            env[RESOLVE_ENV] = "0"
        row: dict[str, Any] = {"check": f"fork-child{'' if resolve else '-resolve-off'}", "resolve": resolve}
        try:
            done = subprocess.run([sys.executable, "-c", FORK_CHILD], env=env, capture_output=True, text=True,
                                  timeout=120, stdin=subprocess.DEVNULL)
            row["rc"] = done.returncode
            if done.returncode != 0 or not done.stdout.strip():
                row.update(ok=False, stderr=done.stderr[-2000:])
            else:
                got = json.loads(done.stdout.strip().splitlines()[-1])
                child = got["child"]
                dropped = not child["handles"]["fds"] and not child["handles"]["maps"]
                pytorch_error = "forked subprocess" in child.get("cuda", "")
                row.update(got, dropped=dropped, pytorch_error=pytorch_error)
                row["ok"] = (got["child_exit"] == 0 and pytorch_error and bool(got["parent"]["fds"])
                             and (dropped if resolve else bool(child["handles"]["fds"])))
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            row.update(ok=False, error=f"{type(e).__name__}: {e}")
        out.append(row)
        print(json.dumps(row, default=str), flush=True)
    return out


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": sys.version.split()[0]}
    for dist in ("torch", "transformers", "accelerate", "lightning", "pytorch-lightning", "triton"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        out["gpus"] = smi.stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        out["gpus"] = None
    out["kernel"] = os.uname().release
    return out


def check_table(checks: list[dict[str, Any]]) -> str:
    lines = []
    for c in checks:
        if c["check"].startswith("fork-child"):
            child = c.get("child") or {}
            what = (f"child handles {child.get('handles')}, CUDA in child: {str(child.get('cuda'))[:80]}, "
                    f"exit {c.get('child_exit')}") if child else c.get("error") or c.get("stderr", "")[-200:]
        else:
            f = c.get("failure") or {}
            what = (f"refused {f.get('reason')} before freeze={f.get('refused_before_freeze')}, "
                    f"pids {c.get('refused_pids')}, trainer finished {c.get('trainer_finished')}: "
                    f"{str(f.get('detail'))[:160]}") if c.get("refused") else \
                (c.get("error") or f"NOT refused (image {c.get('image_bytes')} bytes)")
        lines.append(f"{c['check']:<32} {'ok' if c.get('ok') else 'FAIL':<5} {' '.join(str(what).split())[:400]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--rows", help=f"comma-separated, of: {', '.join(ROWS)} (default: all)")
    ap.add_argument("--no-checks", action="store_true", help="skip the fork-child and refusal checks")
    ap.add_argument("--steps", type=int, help="steps of every row (default: each row's own, 60 or 90)")
    ap.add_argument("--at", type=int, help="snapshot after this step (default: each row's own, 25 or 60)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="skip rows that would end past this many seconds from the start (default 480: with "
                         "setup.sh, one call of the GPU machine's 10 minutes)")
    ap.add_argument("--workdir", help="images and working files (default: a new directory in /var/tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    args = ap.parse_args()
    t0 = time.monotonic()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in args.rows.split(",") if r] if args.rows else list(ROWS)
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        print(f"workloads.py: unknown rows {unknown}; known: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("workloads.py: must run as root (CRIU)", file=sys.stderr)
        return 2
    base = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="snapguard-workloads-",
                                                                         dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    base.mkdir(parents=True, exist_ok=True)
    config = load()
    meta = {"versions": versions(), "workdir": str(base), "argv": sys.argv[1:], "started": time.time()}
    print(json.dumps(meta, default=str), flush=True)
    report: dict[str, Any] = {"device": args.device, "meta": meta, "checks": [], "rows": []}
    json_path = out / "workloads.json"

    def save() -> None:
        report["seconds"] = time.monotonic() - t0
        json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")

    try:
        if not args.no_checks:
            if args.device == "cuda":
                report["checks"] += fork_child_check(os.path.join(config.state_dir, "take"))
                save()
            for row, hooked in (("dataloader", True), ("compile", False)):
                if args.device == "cpu":
                    break  # no GPU handles on the CPU: nothing to refuse
                try:
                    check = refusal_check(ROWS[row], base / "checks", config, device=args.device, hooked=hooked,
                                          resolve=False, caches=base / "caches")
                except Exception as e:  # recorded; the rows still run
                    check = {"check": f"{row}-refusal", "ok": False, "error": f"{type(e).__name__}: {e}"}
                print(json.dumps(check, default=str), flush=True)
                report["checks"].append(check)
                save()
        # the rows, the JSON rewritten after each (run_matrix writes its own file: ours holds both)
        report["rows"] = run_matrix(config, base / "rows", device=args.device, rows=rows,
                                    json_path=out / "workloads-rows.json", budget_s=args.budget_s, steps=args.steps,
                                    at=args.at, meta=meta, logs_to=out / "logs", started=t0, caches=base / "caches")
        save()
    finally:
        save()
        if not args.keep and not args.workdir:
            shutil.rmtree(base, ignore_errors=True)
    text = table(report["rows"])
    if report["checks"]:
        text += "\n\nchecks\n" + check_table(report["checks"])
    ok = all(r.get("ok") or r.get("skipped") for r in report["rows"]) and all(c.get("ok") for c in report["checks"])
    text += f"\n\nworkloads ({args.device}): {'PASS' if ok else 'FAIL'} in {time.monotonic() - t0:.0f} s"
    (out / "workloads.txt").write_text(text + "\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
