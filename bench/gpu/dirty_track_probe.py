"""Whether this machine can copy a process's memory before a snapshot's stall with CRIU's pre-dump:
the kernel's soft-dirty bits (CONFIG_MEM_SOFT_DIRTY, what CRIU's --track-mem reads), CRIU's own
`criu check --feature mem_dirty_track`, and a real `criu pre-dump --track-mem` of a small process
followed by `criu dump --prev-images-dir --track-mem`. Prints one JSON object.

    python3 bench/gpu/dirty_track_probe.py [--criu /usr/local/sbin/criu]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HOLDER = "import time\nb = bytearray(256 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n" \
         "while True:\n    b[0] = (b[0] + 1) % 256\n    time.sleep(0.01)\n"


def kernel_config() -> dict[str, str]:
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            text = f.read()
    except OSError as e:
        return {"error": str(e)}
    keys = ("CONFIG_MEM_SOFT_DIRTY", "CONFIG_USERFAULTFD", "CONFIG_PTE_MARKER_UFFD_WP", "CONFIG_HAVE_ARCH_SOFT_DIRTY")
    found = {}
    for line in text.splitlines():
        for k in keys:
            if line.startswith(k + "=") or line == f"# {k} is not set":
                found[k] = line
    return found


def run(argv: list[str]) -> dict[str, object]:
    t = time.monotonic()
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"argv": argv, "error": str(e)}
    return {"argv": argv[:2], "rc": out.returncode, "s": round(time.monotonic() - t, 3),
            "said": (out.stdout + out.stderr).strip().splitlines()[-3:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--criu", default="/usr/local/sbin/criu")
    args = ap.parse_args()
    res: dict[str, object] = {"kernel": os.uname().release, "config": kernel_config(),
                              "check": run([args.criu, "check", "--feature", "mem_dirty_track"])}
    work = tempfile.mkdtemp(prefix="dirty-probe-")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        time.sleep(1.5)
        pre, final = os.path.join(work, "pre"), os.path.join(work, "final")
        os.mkdir(pre)
        os.mkdir(final)
        common = ["--tree", str(holder.pid), "--shell-job", "-v3", "--log-file", "criu.log"]
        res["pre_dump"] = run([args.criu, "pre-dump", *common, "--images-dir", pre, "--track-mem"])
        if res["pre_dump"].get("rc") != 0:  # type: ignore[union-attr]
            # without the tracking: what CRIU 4.2.1 does when told nothing of it
            untracked = os.path.join(work, "untracked")
            os.mkdir(untracked)
            res["pre_dump_untracked"] = run([args.criu, "pre-dump", *common, "--images-dir", untracked])
            log = os.path.join(untracked, "criu.log")
            if os.path.exists(log):
                with open(log, errors="replace") as f:
                    res["untracked_errors"] = [ln for ln in f.read().splitlines() if "Error" in ln][:4]
        if res["pre_dump"].get("rc") == 0:  # type: ignore[union-attr]
            res["dump"] = run([args.criu, "dump", *common, "--images-dir", final, "--track-mem",
                               "--prev-images-dir", "../pre", "--leave-running"])
            res["bytes"] = {d: sum(os.path.getsize(os.path.join(p, n)) for n in os.listdir(p))
                            for d, p in (("pre", pre), ("final", final))}
        for d in (pre, final):
            log = os.path.join(d, "criu.log")
            if os.path.exists(log):
                with open(log, errors="replace") as f:
                    res[f"{os.path.basename(d)}_errors"] = [ln for ln in f.read().splitlines() if "Error" in ln][:4]
    finally:
        holder.kill()
        holder.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
