"""Added latency of the pass-through path: `snapguard-runc state ID` against `runc state ID`.

A real container is created from a busybox bundle; both commands run against it, interleaved, at
least 50 times each. Target: median added latency at most 10 ms.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, summary, write  # noqa: E402

RUNC = "/usr/sbin/runc"


def make_bundle(base: Path) -> Path:
    bundle = base / "bundle"
    (bundle / "rootfs" / "bin").mkdir(parents=True)
    shutil.copy("/bin/busybox", bundle / "rootfs" / "bin" / "busybox")
    (bundle / "rootfs" / "bin" / "sleep").symlink_to("busybox")
    subprocess.run([RUNC, "spec", "--bundle", str(bundle)], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"].update(terminal=False, args=["/bin/sleep", "3600"])
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


def time_calls(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    sg = os.path.join(os.path.dirname(sys.executable), "snapguard-runc")
    base = Path(tempfile.mkdtemp(prefix="sg-bench-pt-"))
    root, cid = base / "root", "bench-pt"
    bundle = make_bundle(base)
    subprocess.run([RUNC, "--root", str(root), "run", "--detach", "--bundle", str(bundle), cid], check=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env_default = dict(os.environ)  # config file or built-in default path
    env_pinned = {**os.environ, "SNAPGUARD_RUNC": RUNC}  # the cheapest source: no TOML parse
    arms = {"runc": ([RUNC, "--root", str(root), "state", cid], env_default),
            "snapguard-runc (SNAPGUARD_RUNC)": ([sg, "--root", str(root), "state", cid], env_pinned),
            "snapguard-runc (config file)": ([sg, "--root", str(root), "state", cid],
                                             {**os.environ, "SNAPGUARD_CONFIG": str(base / "config.toml")})}
    (base / "config.toml").write_text(f'runc = "{RUNC}"\n')
    samples: dict[str, list[float]] = {k: [] for k in arms}
    try:
        for argv, env in arms.values():
            time_calls(argv, env)  # warm caches
        for _ in range(args.calls):
            for name, (argv, env) in arms.items():
                samples[name].append(time_calls(argv, env))
    finally:
        subprocess.run([RUNC, "--root", str(root), "delete", "--force", cid], check=False)
        shutil.rmtree(base, ignore_errors=True)
    stats = {k: summary(v) for k, v in samples.items()}
    base_ms = stats["runc"]["median"] * 1e3
    print(f"{'arm':<32} {'median ms':>9} {'p10':>7} {'p90':>7} {'added ms':>9} {'ratio':>6}")
    for name, s in stats.items():
        med = s["median"] * 1e3
        print(f"{name:<32} {med:>9.2f} {s['p10'] * 1e3:>7.2f} {s['p90'] * 1e3:>7.2f} "
              f"{med - base_ms:>9.2f} {med / base_ms:>6.2f}")
    added = {k: (s["median"] - stats["runc"]["median"]) * 1e3 for k, s in stats.items() if k != "runc"}
    path = write("passthrough", {"calls": args.calls, "stats": stats, "added_ms": added, "target_added_ms": 10,
                                 "rev": git_rev(), "python": sys.executable})
    print(f"target: added median <= 10 ms; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
