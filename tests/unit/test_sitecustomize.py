"""The take point's sitecustomize runs the sitecustomize it shadows (Debian's, a venv's, the
workload's), in real interpreters started the way a trainer is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from snapguard.takepoint import site_dir, socket_path

REPO = Path(__file__).resolve().parents[2]
PROBE = ("import os, sys, time; time.sleep(0.3); "
         "print(os.environ.get('WORKLOAD_SITE'), os.path.exists(sys.argv[1].replace('PID', str(os.getpid())))) ")


def run(tmp_path: Path, workload_site: str | None, take: bool) -> subprocess.CompletedProcess[str]:
    theirs = tmp_path / "theirs"
    theirs.mkdir(exist_ok=True)
    if workload_site is not None:
        (theirs / "sitecustomize.py").write_text(workload_site)
    env = {k: v for k, v in os.environ.items() if k not in ("SNAPGUARD_TAKE_DIR", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([site_dir(), str(REPO), str(theirs)])
    take_dir = tmp_path / "take"
    if take:
        env["SNAPGUARD_TAKE_DIR"] = str(take_dir)
    return subprocess.run([sys.executable, "-c", PROBE, socket_path(str(take_dir), 0).replace("0.sock", "PID.sock")],
                          env=env, capture_output=True, text=True, timeout=60, check=False)


def test_workload_sitecustomize_runs_after_the_take_point(tmp_path: Path) -> None:
    done = run(tmp_path, "import os\nos.environ['WORKLOAD_SITE'] = 'ran'\n", take=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ran", "True"]  # theirs ran, and the take point listens


def test_without_take_dir_only_chains(tmp_path: Path) -> None:
    done = run(tmp_path, "import os\nos.environ['WORKLOAD_SITE'] = 'ran'\n", take=False)
    assert done.stdout.split() == ["ran", "False"]


def test_a_failing_workload_sitecustomize_is_one_line_and_the_take_point_stays(tmp_path: Path) -> None:
    done = run(tmp_path, "raise RuntimeError('broken image')\n", take=True)
    assert done.returncode == 0 and done.stdout.split() == ["None", "True"]
    assert done.stderr.strip().splitlines() == [
        "Error in sitecustomize (chained by snapguard); RuntimeError: broken image"]
