"""Issue 3 on the H200: an NVML-only process and a forked worker next to a PyTorch CUDA process,
in one process tree. `snapguard preflight --pid` must report the NVML holder and the forked worker
as STRAY_GPU_DEVICE_HANDLE with their pids and recognise the CUDA process as snapshot-able."""

import json
import os
import subprocess
import sys
import time

JOB = r"""
import os, subprocess, sys, time
cuda = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time, torch
x = torch.ones(256 << 20, device="cuda")  # 1 GiB
torch.cuda.synchronize()
if os.fork() == 0:          # a worker forked after CUDA init, as DataLoader workers are
    time.sleep(600); os._exit(0)
print("cuda-ready", flush=True); time.sleep(600)
'''], stdout=sys.stdout)
nvml = subprocess.Popen([sys.executable, "-c", '''
import time, pynvml
pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0); pynvml.nvmlDeviceGetName(h)
print("nvml-ready", flush=True); time.sleep(600)
'''], stdout=sys.stdout)
time.sleep(600)
"""


def main() -> int:
    out_dir = sys.argv[1]
    job = subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE, text=True, start_new_session=True)
    ready = set()
    while len(ready) < 2:
        ready.add(job.stdout.readline().strip())
    time.sleep(1)
    from snapguard.config import load
    from snapguard.preflight import node_report, pid_report

    t0 = time.perf_counter()
    report = pid_report(job.pid, load())
    pid_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    node = node_report(load())
    node_s = time.perf_counter() - t0
    procs = {p["pid"]: p for p in report.processes or []}
    stray = {f.evidence["pid"]: f.detail for f in report.findings if f.reason.name == "STRAY_GPU_DEVICE_HANDLE"}
    cuda = [p for p in procs.values() if p["gpu"]]
    summary = {"job_pid": job.pid, "verdict": report.verdict, "pid_report_s": pid_s, "node_report_s": node_s,
               "cuda_processes": cuda, "stray": stray,
               "blockers": [f.reason.name for f in report.blockers],
               "node_verdict": node.verdict, "node_findings": [str(f) for f in node.findings]}
    with open(os.path.join(out_dir, "stray_handles.json"), "w") as f:
        json.dump({"summary": summary, "pid_report": report.to_dict(), "node_report": node.to_dict()}, f,
                  indent=2, default=str)
    print(report.to_text())
    print()
    print(node.to_text())
    print(json.dumps(summary, indent=1, default=str))
    os.killpg(job.pid, 9)
    ok = (len(cuda) == 1 and len(stray) == 2 and cuda[0]["pid"] not in stray
          and set(summary["blockers"]) == {"STRAY_GPU_DEVICE_HANDLE"})
    print("stray handles demo:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
