"""The GPU rows of the fault matrix (tests/system/test_faults.py has the CPU rows): each step of a
snapshot past the CUDA lock failed in turn on one live trainer, through snapguard's own pipeline,
then a stop snapshot whose first restore fails in the driver; the trainer must finish
bit-identical to an uninterrupted reference run, and after every row it is either running (CUDA
state `running`) or cleanly stopped with a whole image.

Rows (leave-running unless said):
  cuda-lock       another tool holds the CUDA lock -> CUDA_CHECKPOINT_FAILED at the lock, unlocked
  page-dump       the image dir is a 64 MiB tmpfs: CRIU's page dump hits ENOSPC -> CRIU_DUMP_FAILED;
                  with --take-point and the spill (a bare trainer's moved bytes in a file the executor
                  writes) the executor finds no room for them before anything is frozen ->
                  IMAGE_WRITE_FAILED (run 12e found PREFLIGHT_FAILED, the reason it had then)
  criu-killed     CRIU SIGKILLed while the GPU state is checkpointed -> CRIU_DUMP_FAILED, restored
  criu-hang       CRIU hangs (a wrapper that sleeps on `dump`), criu_timeout_s 1: snapguard's deadline
                  kills it -> CRIU_TIMEOUT, CUDA restored
  seal            a FIFO planted in the image dir: the dump succeeds, the seal refuses it -> IMAGE_WRITE_FAILED
  stop            a stop snapshot (whole image)
  device-map      its restore with a device map onto an absent GPU: the preflight refuses it before
                  CRIU runs -> GPU_IDENTITY_MISMATCH, the image still whole
  cuda-restore    its restore while another process takes the GPU's free memory once CRIU has started
                  (after the preflight's free-memory check passed): the driver's restore in CRIU's
                  plugin fails -> CRIU_RESTORE_FAILED or CUDA_RESTORE_FAILED, nothing of the restored
                  copy left running, the image still whole
  restore         the same image restored as it is: the trainer goes on and finishes

Usage: faults.py OUT_DIR [STEPS] [--take-point]

With --take-point the faulted trainer runs the take-point hook, so every row's snapshot holds it at
a step boundary first and, by default, moves its tensors' bytes to host memory for the hold
(SNAPGUARD_TAKE_OFFLOAD): each failure must then also bring them back onto the GPU.
"""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from snapguard import cuda, image, pipeline
from snapguard.config import load
from snapguard.devicemap import DeviceMap
from snapguard.reasons import SnapguardError
from snapguard_lab.torch_drill import Trainer, compare

ABSENT_GPU = "GPU-00000000-0000-0000-0000-000000000000"
# the cuda-restore row's other tenant: its CUDA context up front, then, on "take", all the GPU's free
# memory but 64 MiB, held until it is killed
OCCUPIER = """
import sys, torch
torch.empty(1, device="cuda")
print("ready", flush=True)
sys.stdin.readline()
free, _ = torch.cuda.mem_get_info()
hold = torch.empty(max(free - (64 << 20), 1), dtype=torch.uint8, device="cuda")
print(f"holding {hold.numel()} bytes", flush=True)
sys.stdin.readline()
"""


def _line(pipe: Any, timeout: float) -> str:
    """One line from a child's unbuffered pipe, or what came before the deadline or its end."""
    got = b""
    deadline = time.monotonic() + timeout
    while not got.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([pipe], [], [], left)[0]:
            break
        byte = pipe.read(1)
        if not byte:
            break
        got += byte
    return got.decode(errors="replace").strip()


def _whole(images: Path) -> bool | str:
    try:
        image.verify(str(images))
        return True
    except SnapguardError as e:
        return e.reason.name


def _criu_children() -> list[int]:
    """CRIU processes started by this one (the pipeline's runner)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if comm == "criu" and int(fields[1]) == os.getpid():
            found.append(int(name))
    return found


def _state(driver: Any, pid: int) -> str:
    """The CUDA state of pid, or what became of the process (a stop snapshot kills it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return "gone"
    except OSError:
        return "gone"
    try:
        return str(driver.state(pid))
    except cuda.CudaError as e:
        return f"error: {e}"


def _row(name: str, pid: int | None, driver: Any, run: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    row: dict[str, Any] = {"row": name}
    try:
        result = run()
        row.update(outcome="ok", result={k: result.get(k)
                                         for k in ("pid", "image_bytes", "timings", "counts", "take_point")})
    except SnapguardError as e:
        f = e.failure
        row.update(outcome="refused", reason=f.reason.name, detail=f.detail, workload_intact=f.workload_intact,
                   cuda_recovery=f.evidence.get("cuda_recovery"),
                   restored_tree_ended=f.evidence.get("restored_tree_ended"),
                   criu_errors=[x["message"] for x in f.evidence.get("errors", [])][:2])
    row["seconds"] = time.monotonic() - t0
    if pid is not None:
        row["state_after"] = _state(driver, pid)
    print(json.dumps(row, default=str), flush=True)
    return row


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--take-point"]
    hooked = len(args) < len(sys.argv) - 1
    if "-h" in args or "--help" in args:
        print(__doc__)
        return 0
    if any(a.startswith("-") for a in args) or not 1 <= len(args) <= 2 or (len(args) == 2 and not args[1].isdigit()):
        print("usage: faults.py OUT_DIR [STEPS] [--take-point]  (--help: what it runs)", file=sys.stderr)
        return 2
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)  # written last, after minutes of rows: make sure it can be
    steps = int(args[1]) if len(args) > 1 else 200
    base = Path(tempfile.mkdtemp(prefix="faults-", dir="/tmp"))  # 0700, fresh on a machine kept warm
    config = load()
    ref = Trainer(base, "reference", steps)
    ref.start()
    ref_result = ref.wait_done()
    run = Trainer(base, "faulted", steps, trimmed=hooked)
    pid = run.start(os.path.join(config.state_dir, "take") if hooked else None)
    driver = cuda.load()
    rows = []

    def request(images: Path, **kw: Any) -> pipeline.Request:
        return pipeline.Request(str(images), timeouts=pipeline.Timeouts.from_config(config), **kw)

    def checkpoint(images: Path, cfg: Any = config, **kw: Any) -> dict[str, Any]:
        return pipeline.checkpoint(pipeline.CriuRunner(cfg.criu, pid),
                                   pipeline.Request(str(images), timeouts=pipeline.Timeouts.from_config(cfg), **kw),
                                   cfg)

    run.wait_step(20)
    # cuda-lock: another tool (here the driver API in this process) holds the lock
    driver.lock(pid, 10_000)
    rows.append(_row("cuda-lock", pid, driver, lambda: checkpoint(base / "lock.img", leave_running=True)))

    # page-dump: ENOSPC in CRIU's page dump, after the executor checkpointed the GPU state
    run.wait_step(40)
    tiny = base / "tiny"
    tiny.mkdir()
    os.system(f"mount -t tmpfs -o size=64m,mode=0700 tmpfs {tiny}")
    try:
        rows.append(_row("page-dump", pid, driver, lambda: checkpoint(tiny / "img", leave_running=True)))
    finally:
        os.system(f"umount {tiny}")

    # criu-killed: SIGKILL to CRIU once the GPU state is checkpointed
    run.wait_step(60)

    def killer() -> None:
        # the executor checkpoints the GPU state before CRIU starts: kill CRIU as soon as it runs
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            running = _criu_children()
            if running and driver.state(pid) == "checkpointed":
                time.sleep(0.3)  # into its dump
                for criu_pid in running:
                    os.kill(criu_pid, signal.SIGKILL)
                killed.append(running)
                return
            time.sleep(0.002)

    killed: list[list[int]] = []

    t = threading.Thread(target=killer)
    t.start()
    rows.append(_row("criu-killed", pid, driver, lambda: checkpoint(base / "killed.img", leave_running=True)))
    t.join()
    rows[-1]["criu_killed"] = killed

    # criu-hang: a CRIU that never finishes its dump; snapguard's deadline (10 x criu_timeout_s)
    run.wait_step(80)
    bindir = base / "hangbin"
    bindir.mkdir(mode=0o700)
    hang = bindir / "criu"
    hang.write_text(f'#!/bin/sh\nif [ "$1" = dump ]; then exec sleep 3600; fi\nexec {config.criu} "$@"\n')
    os.chmod(hang, 0o755)
    hang_config = load()
    hang_config.criu = str(hang)
    hang_config.criu_timeout_s = 1
    rows.append(_row("criu-hang", pid, driver,
                     lambda: checkpoint(base / "hang.img", cfg=hang_config, leave_running=True)))

    # seal: a FIFO in the image dir; the dump succeeds, the seal refuses it
    run.wait_step(100)
    sealdir = base / "seal.img"
    sealdir.mkdir(mode=0o700)
    os.mkfifo(sealdir / "planted.fifo", 0o600)
    rows.append(_row("seal", pid, driver, lambda: checkpoint(sealdir, leave_running=True)))
    rows[-1]["marker_present"] = (sealdir / image.MARKER_NAME).exists()

    # stop, then a restore the driver refuses, then the restore that works
    run.wait_step(120)
    stop_img = base / "stop.img"
    rows.append(_row("stop", pid, driver, lambda: checkpoint(stop_img, leave_running=False)))
    assert run.proc is not None
    run.proc.wait(timeout=60)
    manifest = image.verify(str(stop_img)).to_json()
    old = manifest["gpu"]["gpus"][0]["uuid"]
    rows.append(_row("device-map", None, driver, lambda: pipeline.restore(
        pipeline.CriuRunner(config.criu), request(stop_img, device_map=DeviceMap(((old, ABSENT_GPU),))), config)))
    rows[-1]["image_whole_after"] = _whole(stop_img)
    # cuda-restore: the preflight also refuses a GPU without the image's memory free, so the memory
    # is taken in the window it cannot see: by a process that already has its CUDA context, the
    # moment the restore's CRIU appears
    occupier = subprocess.Popen([sys.executable, "-c", OCCUPIER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                bufsize=0)
    assert occupier.stdin is not None and occupier.stdout is not None
    took: list[str] = []
    row_done = threading.Event()

    def grab() -> None:
        deadline = time.monotonic() + 120
        while not _criu_children():
            if row_done.is_set() or time.monotonic() > deadline:
                return  # refused before CRIU ran: nothing taken, the row's check fails
            time.sleep(0.002)
        try:
            occupier.stdin.write(b"take\n")  # type: ignore[union-attr]
            took.append(_line(occupier.stdout, 60))  # type: ignore[arg-type]
        except OSError as e:  # the occupier died: nothing taken
            took.append(f"error: {e}")

    try:
        ready = _line(occupier.stdout, 120)
        if ready == "ready":
            t = threading.Thread(target=grab, daemon=True)
            t.start()
            rows.append(_row("cuda-restore", None, driver, lambda: pipeline.restore(
                pipeline.CriuRunner(config.criu), request(stop_img), config)))
            row_done.set()
            t.join(timeout=90)
        else:  # a row that failed, not a run that stopped: the image's last restore still runs
            rows.append({"row": "cuda-restore", "outcome": "error", "seconds": 0.0,
                         "detail": f"the memory occupier did not start: {ready!r}"})
    finally:
        occupier.kill()
        occupier.wait(timeout=60)
    rows[-1].update(occupier=took, image_whole_after=_whole(stop_img), restored_copy_after=_state(driver, pid))
    t_restore = time.time()
    restored: dict[str, Any] = {}

    def restore() -> dict[str, Any]:
        restored.update(pipeline.restore(pipeline.CriuRunner(config.criu), request(stop_img), config))
        return restored

    rows.append(_row("restore", None, driver, restore))
    verdict: dict[str, Any] = {"bit_identical": False}
    if restored.get("pid"):
        run.restored_pid = restored["pid"]
        first = run.first_step_after(t_restore)
        rows[-1]["restore_to_first_new_step_s"] = first[2] - t_restore
        result = run.wait_done(timeout=600, pid=restored["pid"])
        verdict = compare(ref, run, ref_result, result)
    # cuda-lock: the driver may answer a second lock as an error or take it; either way the
    # process must be left running
    expected = {"cuda-lock": ("refused", "ok"), "page-dump": ("refused",), "criu-killed": ("refused",),
                "criu-hang": ("refused",), "seal": ("refused",), "stop": ("ok",), "device-map": ("refused",),
                "cuda-restore": ("refused",), "restore": ("ok",)}
    after = {"stop": "gone"}  # CRIU ends the stopped trainer; every other row leaves it running
    checks = {r["row"]: r["outcome"] in expected[r["row"]]
              and r.get("state_after", after.get(r["row"], "running")) == after.get(r["row"], "running")
              and (r.get("workload_intact", True) is not False or r["row"] == "cuda-restore") for r in rows}
    # a refused restore leaves the image whole for the retry; the driver's refusal also leaves
    # nothing of what CRIU brought back
    rowmap = {r["row"]: r for r in rows}
    checks["device-map"] = checks["device-map"] and rowmap["device-map"].get("reason") == "GPU_IDENTITY_MISMATCH" \
        and rowmap["device-map"].get("image_whole_after") is True
    cr = rowmap["cuda-restore"]
    checks["cuda-restore"] = checks["cuda-restore"] and cr.get("image_whole_after") is True \
        and cr.get("reason") in ("CRIU_RESTORE_FAILED", "CUDA_RESTORE_FAILED") \
        and cr.get("restored_copy_after") == "gone" and (cr.get("occupier") or [""])[0].startswith("holding")
    report = {"steps": steps, "rows": rows, "checks": checks, **verdict,
              "stat_mode_of_stop_image": oct(stat.S_IMODE(os.stat(stop_img).st_mode))}
    (out / "faults.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"{'row':<13} {'outcome':<8} {'reason':<24} {'state after':<12} {'seconds':>7}")
    for r in rows:
        print(f"{r['row']:<13} {r['outcome']:<8} {r.get('reason', '-'):<24} {r.get('state_after', '-'):<12} "
              f"{r['seconds']:7.2f}")
    ok = verdict["bit_identical"] and all(checks.values())
    print("faults:", "PASS" if ok else "FAIL", json.dumps(checks))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
