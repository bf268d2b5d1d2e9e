"""bundles.host_bundle's mount list: every mount under a bound host directory gets its own bind
(runc hands CRIU spec binds as external mounts), a directory inside a bound one none; and
release_mounts, which keeps a bundle's removal from reaching through a leftover mount into the
host. Checked against real tmpfs mounts."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapguard_lab.bundles import host_bundle, release_mounts

pytestmark = pytest.mark.root  # real tmpfs mounts


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


def test_directory_inside_a_bound_one_is_not_bound_again(tmp_path: Path) -> None:
    repo, venv = tmp_path / "repo", tmp_path / "repo" / ".venv"
    venv.mkdir(parents=True)
    bundle = host_bundle(tmp_path / "bundle", ["/bin/true"], [], [str(venv), str(repo)])
    spec = json.loads((bundle / "config.json").read_text())
    assert [m["destination"] for m in spec["mounts"] if m["type"] == "bind"] == [str(repo)]


def test_release_mounts_unmounts_deepest_first(host_dir: Path, tmp_path: Path) -> None:
    # a bind of the host directory left inside a rootfs, as a restore can leave one
    inside = tmp_path / "bundle" / "rootfs" / "host"
    inside.mkdir(parents=True)
    subprocess.run(["mount", "--rbind", str(host_dir), str(inside)], check=True)
    released = release_mounts(tmp_path / "bundle")
    assert set(released) == {str(inside), str(inside / "driver mount")}
    assert release_mounts(tmp_path / "bundle") == []
    assert (host_dir / "driver mount").is_dir()  # the host's side is untouched
