"""How long a snapshot's preflight takes with the host checks' caches removed (cold: `criu check`,
`cuda-checkpoint -h` and libcuda's symbol table asked anew) and kept (warm), on this machine.

The preflight of `snapguard checkpoint --pid` (preflight.pid_report) of a sleeping child, under the
node's config ($SNAPGUARD_CONFIG, else /etc/snapguard/config.toml, where there is one) copied with a
state directory of its own, emptied before each cold run; each run in a process of its own; per
run the whole report's seconds and each host check's. Runs as root (CRIU's check needs it).

    .venv/bin/python bench/preflight_cold.py OUT.json [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from snapguard import preflight
from snapguard.config import load


def one(pid: int, env: dict[str, str], state: str, cold: bool) -> dict[str, object]:
    if cold:
        shutil.rmtree(state, ignore_errors=True)
    config = load(env)
    t = time.monotonic()
    report = preflight.pid_report(pid, config)
    seconds = time.monotonic() - t
    return {"s": round(seconds, 4), "exit": report.exit_code,
            "checks_s": {c.name: round(c.duration_s, 4) for c in report.checks}}


def sample(pid: int, env: dict[str, str], state: str, cold: bool) -> dict[str, object]:
    """one() in a process of its own: what a process remembers (NVML's load, libcuda's symbols read
    once per process) is not carried from one sample to the next; the imports are not timed."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import preflight_cold as p; "
            "print(json.dumps(p.one(int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], sys.argv[5] == '1')))")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), str(pid),
                          json.dumps(env), state, "1" if cold else "0"],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="snapguard-preflight-cold-")
    os.chmod(root, 0o700)
    node = os.environ.get("SNAPGUARD_CONFIG", "/etc/snapguard/config.toml")
    with open(os.path.join(root, "config.toml"), "w") as f:  # the node's settings, a state dir of its own
        f.write(open(node).read() if os.path.isfile(node) else "")
    state = os.path.join(root, "state")
    env = {"SNAPGUARD_CONFIG": os.path.join(root, "config.toml"), "SNAPGUARD_STATE_DIR": state}
    child = subprocess.Popen(["/bin/sleep", "600"], start_new_session=True)
    try:
        runs = {"cold": [sample(child.pid, env, state, True) for _ in range(args.runs)],
                "warm": [sample(child.pid, env, state, False) for _ in range(args.runs)]}
    finally:
        child.kill()
        child.wait()
        shutil.rmtree(root, ignore_errors=True)
    out = {"argv": sys.argv[1:], "kernel": os.uname().release, "runs": runs,
           "median_s": {k: statistics.median(r["s"] for r in v) for k, v in runs.items()}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["median_s"]), {k: v[0]["checks_s"] for k, v in runs.items()})


if __name__ == "__main__":
    main()
