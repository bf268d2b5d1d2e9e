"""testbed.host_bundle's mount list: every mount under a bound host directory gets its own bind
(runc hands CRIU spec binds as external mounts), checked against a real tmpfs mount."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapguard.testbed import host_bundle


@pytest.fixture
def host_dir(tmp_path: Path) -> Iterator[Path]:
    top = tmp_path / "host dir"  # a space: mountinfo writes it as \040
    inner = top / "driver mount"
    inner.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "snapguard-test", str(inner)], check=True)
    try:
        yield top
    finally:
        subprocess.run(["umount", str(inner)], check=True)


def test_submounts_get_binds_of_their_own(host_dir: Path, tmp_path: Path) -> None:
    bundle = host_bundle(tmp_path / "bundle", ["/bin/true"], ["PATH=/bin"], [str(host_dir)],
                         writable={"/out": str(tmp_path)})
    spec = json.loads((bundle / "config.json").read_text())
    binds = [(m["destination"], m["options"]) for m in spec["mounts"] if m["type"] == "bind"]
    assert binds == [(str(host_dir), ["bind", "ro"]), (str(host_dir / "driver mount"), ["bind", "ro"]),
                     ("/out", ["rbind", "rw"])]
    assert not any(n["type"] == "network" for n in spec["linux"]["namespaces"])
