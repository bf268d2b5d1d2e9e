"""A container mount CRIU cannot dump is refused by preflight, before anything is frozen.

A runc container (snapguard_lab.targets.RuncTarget: the host's directories bound into its rootfs,
its /out a recursive bind of a host directory) whose /out has a submount on the host: a bind of
another host directory, which the rbind brings into the container without a mount of its own in
the spec. CRIU fails on it (`mnt: ./out/sub doesn't have a proper root mount`, after the freeze);
snapguard-runc's checkpoint refuses it in preflight with MOUNT_NOT_IN_SPEC naming /out/sub, the
counter running on, no CRIU image written; `snapguard preflight --container` says the same.
The plain container (the existing runc tests, tests/system/test_faults.py and test_parity.py) is
checkpointed as before.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapguard_lab.targets import RuncTarget, snapguard_path, typed_lines

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]


@pytest.fixture
def rbound(tmp_path: Path) -> Iterator[RuncTarget]:
    t = RuncTarget(tmp_path / "target")
    sub = t.out / "sub"
    sub.mkdir(parents=True)
    src = tmp_path / "elsewhere"
    src.mkdir()
    subprocess.run(["mount", "--bind", str(src), str(sub)], check=True, timeout=30)
    try:
        t.start(lines=3)
        yield t
    finally:
        t.stop()
        subprocess.run(["umount", "-l", str(sub)], capture_output=True, check=False, timeout=30)


def test_submount_of_a_recursive_bind_is_refused_before_the_dump(rbound: RuncTarget, tmp_path: Path) -> None:
    images, work = tmp_path / "img", tmp_path / "work"
    t0 = time.monotonic()
    out = rbound.checkpoint(images, work)
    took = time.monotonic() - t0
    lines = typed_lines(out.stderr)
    assert out.returncode == 1 and lines, out.stderr
    assert lines[0].startswith("snapguard MOUNT_NOT_IN_SPEC: /out/sub (") and \
        f"recursive bind (rbind) of {rbound.out} at /out" in lines[0], lines
    assert took < 10, took
    record = rbound.record(images, work)
    assert record is not None and record["reason"] == "MOUNT_NOT_IN_SPEC" and record["workload_intact"] is True
    assert not list(images.glob("pages-*.img")) and not (work / "dump.log").exists()  # CRIU never ran
    assert rbound.alive() and rbound.advancing()
    # the same verdict from the preflight command, as JSON
    pre = subprocess.run([snapguard_path(), "preflight", "--container", rbound.container_id, "--root",
                          str(rbound.root), "--json"], capture_output=True, text=True, timeout=60, env=rbound.env())
    assert pre.returncode == 1, pre.stdout + pre.stderr
    (check,) = [c for c in json.loads(pre.stdout)["checks"] if c["name"] == "container-mounts"]
    (finding,) = check["findings"]
    assert finding["reason"] == "MOUNT_NOT_IN_SPEC" and finding["evidence"]["came_with"] == "/out", finding
    assert os.path.isdir(rbound.out / "sub")
