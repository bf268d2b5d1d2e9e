"""Added latency of the pass-through path: runc against snapguard-runc's C launcher and the Python
snapguard-runc, for `state ID` and `--version`, in one run.

A real container is created from a busybox bundle. The launcher is built for a private config
(snapguard.install.build_launcher, as `snapguard install` builds it) with its pinned file beside
it; the Python entry reads the same config (or is given SNAPGUARD_RUNC, its cheapest source).
Every arm runs once per round, rounds interleaved, at least 40 rounds. Target: the launcher's
median added latency over runc at most 2 ms.

    .venv/bin/python bench/passthrough.py [--calls N]

Prints the table and writes bench/results/passthrough-DATE.json.
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
TARGET_ADDED_MS = 2.0


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


def make_launcher(base: Path, entry: str) -> tuple[Path, Path]:
    """The launcher built for base/etc/config.toml, and that config, with the pinned file beside it."""
    from snapguard import config
    from snapguard.install import build_launcher

    etc = base / "etc"
    etc.mkdir(mode=0o755)
    conf = etc / "config.toml"
    conf.write_text(f'runc = "{RUNC}"\n')
    launcher = base / "snapguard-runc-launcher"
    launcher.write_bytes(build_launcher(str(conf)))
    launcher.chmod(0o755)
    loaded = config.load_with({"SNAPGUARD_CONFIG": str(conf)}, ("runc",))
    assert loaded.source_stat is not None
    pin = config.render_launcher_pin(str(conf), config.pin_stamp(loaded.source_stat), loaded.runc, entry)
    if not config.write_pin_file(config.launcher_pin_path(str(conf)), pin):
        raise SystemExit("cannot write the launcher's pinned file")
    return launcher, conf


def time_call(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=60, help="rounds (at least 40)")
    args = ap.parse_args()
    if args.calls < 40:
        ap.error("--calls must be at least 40")
    sg = os.path.join(os.path.dirname(sys.executable), "snapguard-runc")
    base = Path(tempfile.mkdtemp(prefix="sg-bench-pt-"))
    root, cid = base / "root", "bench-pt"
    bundle = make_bundle(base)
    launcher, conf = make_launcher(base, os.path.realpath(sg))
    subprocess.run([RUNC, "--root", str(root), "run", "--detach", "--bundle", str(bundle), cid], check=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SNAPGUARD_")}
    env_config = {**clean, "SNAPGUARD_CONFIG": str(conf), "SNAPGUARD_STATE_DIR": str(base / "state")}
    env_pinned = {**clean, "SNAPGUARD_RUNC": RUNC}
    programs = {"runc": (RUNC, clean), "launcher (C)": (str(launcher), env_config),
                "snapguard-runc Python (config file)": (sg, env_config),
                "snapguard-runc Python (SNAPGUARD_RUNC)": (sg, env_pinned)}
    commands = {"state": ["--root", str(root), "state", cid], "--version": ["--version"]}
    arms = {(cmd, name): ([prog, *cmd_args], env) for cmd, cmd_args in commands.items()
            for name, (prog, env) in programs.items()}
    samples: dict[tuple[str, str], list[float]] = {k: [] for k in arms}
    try:
        # the launcher answers as runc does, and took runc's route (no Python started: see the timings)
        for cmd_args in commands.values():
            want = subprocess.run([RUNC, *cmd_args], capture_output=True, check=True).stdout
            got = subprocess.run([str(launcher), *cmd_args], capture_output=True, env=env_config, check=True).stdout
            assert got == want, (got, want)
        for argv, env in arms.values():
            time_call(argv, env)  # warm caches (the Python entry's runc path cache too)
        for _ in range(args.calls):
            for key, (argv, env) in arms.items():
                samples[key].append(time_call(argv, env))
    finally:
        subprocess.run([RUNC, "--root", str(root), "delete", "--force", cid], check=False)
        shutil.rmtree(base, ignore_errors=True)

    stats = {cmd: {name: summary(samples[(cmd, name)]) for name in programs} for cmd in commands}
    added = {cmd: {name: (s["median"] - by["runc"]["median"]) * 1e3 for name, s in by.items() if name != "runc"}
             for cmd, by in stats.items()}
    print(f"{'command':<10} {'arm':<40} {'median ms':>9} {'p10':>7} {'p90':>7} {'added ms':>9}")
    for cmd, by in stats.items():
        for name, s in by.items():
            extra = "" if name == "runc" else f"{added[cmd][name]:>9.2f}"
            print(f"{cmd:<10} {name:<40} {s['median'] * 1e3:>9.2f} {s['p10'] * 1e3:>7.2f} {s['p90'] * 1e3:>7.2f} "
                  f"{extra}")
    met = all(added[cmd]["launcher (C)"] <= TARGET_ADDED_MS for cmd in commands)
    path = write("passthrough", {"calls": args.calls, "commands": {k: " ".join(v) for k, v in commands.items()},
                                 "stats": stats, "added_ms": added, "target_added_ms": TARGET_ADDED_MS,
                                 "target_met": met, "rev": git_rev(), "python": sys.executable, "runc": RUNC})
    print(f"target: the launcher adds <= {TARGET_ADDED_MS:g} ms (median): {'met' if met else 'NOT met'}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
