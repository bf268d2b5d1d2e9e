"""The lab's one containerd harness (snapguard_lab.testbed.Containerd) before it starts: the config
it writes with CRI off (versions 2 and 3) and on, the environment and namespace it gives containerd
and ctr, and a caller's own config used as it is. Nothing is started (tests/system starts them)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from snapguard_lab.testbed import COMPAT, HANDLER, PAUSE_IMAGE, SYSTEM_PATH, Containerd


@pytest.mark.parametrize("stack, version", [("debian12", 2), ("compat", 3)])
def test_without_cri_the_plugin_is_off_and_everything_is_in_workdir(tmp_path: Path, stack: str,
                                                                     version: int) -> None:
    ctd = Containerd(str(tmp_path), {"SNAPGUARD_CONFIG": "/x.toml"}, stack=stack)
    config = tomllib.loads(ctd.write_config().read_text())
    assert config["version"] == version and "io.containerd.grpc.v1.cri" in config["disabled_plugins"]
    assert (config["root"], config["state"]) == (str(tmp_path / "root"), str(tmp_path / "state"))
    assert config["grpc"]["address"] == ctd.socket == str(tmp_path / "containerd.sock")
    assert ctd.namespace == ("snapguard" if stack == "debian12" else "snapguard-compat")
    assert ctd.runc_root == f"/run/containerd/runc/{ctd.namespace}"
    assert ctd.env["SNAPGUARD_CONFIG"] == "/x.toml"
    if stack == "compat":
        assert ctd.env["PATH"] == f"{COMPAT}/bin:{SYSTEM_PATH}" and ctd.env["SNAPGUARD_RUNC"] == f"{COMPAT}/bin/runc"
        assert "io.containerd.nri.v1.nri" in config["disabled_plugins"] and (tmp_path / "tmp").is_dir()


def test_with_cri_the_handler_runs_the_runtime_binary(tmp_path: Path) -> None:
    ctd = Containerd(str(tmp_path), stack="compat", cri=True, registry_host="127.0.0.1:5000",
                     runtime_binary="/usr/local/bin/snapguard-runc")
    config = tomllib.loads(ctd.write_config().read_text())
    runtime = config["plugins"]["io.containerd.cri.v1.runtime"]
    handler = runtime["containerd"]["runtimes"][HANDLER]
    assert runtime["containerd"]["default_runtime_name"] == HANDLER
    assert handler["runtime_path"] == f"{COMPAT}/bin/containerd-shim-runc-v2"
    assert handler["options"] == {"BinaryName": "/usr/local/bin/snapguard-runc", "SystemdCgroup": False,
                                  "Root": str(tmp_path / "runc")} and ctd.runc_root == str(tmp_path / "runc")
    assert config["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == PAUSE_IMAGE
    assert "server = \"http://127.0.0.1:5000\"" in (tmp_path / "certs.d" / "127.0.0.1:5000" / "hosts.toml").read_text()
    assert ctd.namespace == "k8s.io" and ctd.env["PATH"].endswith(SYSTEM_PATH)


def test_a_callers_config_is_used_as_it_is(tmp_path: Path) -> None:
    mine = tmp_path / "mine.toml"
    mine.write_text("version = 2\n")
    ctd = Containerd(str(tmp_path / "w"), cri=True, config=str(mine), socket=str(tmp_path / "c.sock"))
    assert ctd.write_config() == mine and mine.read_text() == "version = 2\n"
    assert ctd.socket == str(tmp_path / "c.sock") and ctd.env["PATH"] == SYSTEM_PATH
    assert not (tmp_path / "w").exists()
