"""`snapguard install` against real containerds: the drop-in it writes is what containerd loads, and
a pod whose runtime handler is `snapguard` runs through snapguard-runc.

- containerd 1.6.20 (Debian 12): a version 2 config whose CRI plugin table carries settings of its
  own. 1.x replaces a plugin's whole table with an imported file's, so `containerd config dump` must
  show those settings kept and the runtime added; then containerd starts with it, a host-network
  pod runs through the `snapguard` handler, and snapguard-runc (with the config `snapguard install`
  wrote) is what the shim ran.
- containerd 2.1.9 (the compat stack, /opt/snapguard/compat): the lab's CRI containerd with the
  runtime taken out of its config and put back by `snapguard install`; a pod through the handler
  and a CRI CheckpointContainer whose archive holds snapguard's manifest: the checkpoint went
  through snapguard-runc.
--uninstall then leaves each config as it was.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tarfile
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapguard.names import MANIFEST_NAME
from snapguard_lab import cri as crilab
from snapguard_lab.testbed import COUNTER_IMAGE, Containerd, build_counter_image, compat_missing, snapguard_runc_path

pytestmark = pytest.mark.stack

SNAPGUARD = os.path.join(os.path.dirname(sys.executable), "snapguard")
CONTAINERD_16 = "/usr/bin/containerd"


def _install(*args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([SNAPGUARD, "install", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def _dump(containerd: str, config: Path) -> dict:
    out = subprocess.run([containerd, "--config", str(config), "config", "dump"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return tomllib.loads(out.stdout)


@pytest.fixture
def root_only() -> None:
    if os.geteuid() != 0:
        pytest.fail("containerd needs root (CI and the README's test command run as root)")


# ---------------------------------------------------------------- containerd 1.6

def _config_16(w: Path) -> str:
    return f"""version = 2
root = "{w}/root"
state = "{w}/state"

[grpc]
  address = "{w}/containerd.sock"
[ttrpc]
  address = "{w}/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "{COUNTER_IMAGE}"
    disable_apparmor = true
    restrict_oom_score_adj = true  # no CAP_SYS_RESOURCE here
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = false
          Root = "{w}/runc"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "{w}/cni"
      conf_dir = "{w}/cni"
  [plugins."io.containerd.internal.v1.opt"]
    path = "{w}/opt"
"""


def test_containerd_16_loads_the_dropin_and_runs_a_pod_through_it(tmp_path: Path, root_only: None) -> None:
    w = tmp_path / "ctd16"
    w.mkdir(mode=0o700)
    for d in ("root", "state", "cni", "opt", "runc", "sgstate"):
        (w / d).mkdir(mode=0o700)
    main = w / "config.toml"
    main.write_text(_config_16(w))
    original = main.read_bytes()
    installed = w / "snapguard.toml"
    args = ["--containerd-config", str(main), "--containerd", CONTAINERD_16, "--config", str(installed),
            "--state-file", str(w / "install.json"), "--snapguard-runc", snapguard_runc_path()]
    _install(*args)

    # what containerd 1.6 makes of it: the main config's CRI settings kept, the runtime added
    cri = _dump(CONTAINERD_16, main)["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == COUNTER_IMAGE and cri["restrict_oom_score_adj"] is True
    assert cri["cni"]["conf_dir"] == f"{w}/cni"
    runtimes = cri["containerd"]["runtimes"]
    assert runtimes["runc"]["options"] == {"SystemdCgroup": False, "Root": f"{w}/runc"}
    assert runtimes["snapguard"]["runtime_type"] == "io.containerd.runc.v2"
    assert runtimes["snapguard"]["options"] == {"SystemdCgroup": False, "Root": f"{w}/runc",
                                                 "BinaryName": os.path.realpath(snapguard_runc_path())}

    # containerd 1.6 with it: a pod through the `snapguard` handler; the shim's runc is
    # snapguard-runc reading the config `snapguard install` wrote (it caches the runc it pinned)
    ctd = Containerd(str(w), {"SNAPGUARD_CONFIG": str(installed), "SNAPGUARD_STATE_DIR": str(w / "sgstate")},
                     cri=True, config=str(w / "config.toml"), remove_pods=crilab.remove_all_pods)
    ctd.start()
    try:
        plugins = ctd.ctr("plugins", "ls").stdout
        assert any(line.split()[:2] == ["io.containerd.grpc.v1", "cri"] and line.split()[-1] == "ok"
                   for line in plugins.splitlines()), plugins
        tarball = w / "counter.tar"
        build_counter_image(str(tarball))
        imported = ctd.ctr("images", "import", "--snapshotter", "overlayfs", str(tarball), check=False)
        assert imported.returncode == 0, imported.stderr
        client = crilab.Cri(ctd.socket)
        try:
            uid = str(uuid.uuid4())
            (w / "pods").mkdir()
            sandbox = client.sandbox_config("install-pod", "default", uid, str(w / "pods"))
            pod = client.run_sandbox(sandbox)  # runtime_handler `snapguard`
            cid = client.create(pod, sandbox, client.container_config("counter", COUNTER_IMAGE, sandbox))
            client.start(cid)
            deadline = time.monotonic() + 20
            while len(client.exec_sync(cid, ["cat", "/out/counter.log"]).splitlines()) < 5:
                assert time.monotonic() < deadline, "the counter did not count"
                time.sleep(0.1)
            info = ctd.ctr("containers", "info", cid).stdout
            runtime = json.loads(info)["Runtime"]  # options: containerd.runc.v1.Options, protobuf
            assert runtime["Name"] == "io.containerd.runc.v2"
            assert os.path.realpath(snapguard_runc_path()).encode() in base64.b64decode(runtime["Options"]["value"])
            # and a snapshot of it through the same runtime: snapguard-runc's guarded checkpoint
            ck = ctd.ctr("tasks", "checkpoint", "--image-path", str(w / "image"), "--work-path", str(w / "work"), cid,
                         check=False)
            assert ck.returncode == 0, ck.stderr + (w / "containerd.log").read_text()[-2000:]
            assert (w / "image" / MANIFEST_NAME).is_file() and (w / "work" / "snapguard-result.json").is_file()
            assert client.state(cid) == "CONTAINER_RUNNING"  # leave-running
        finally:
            client.close()
        cache = (w / "sgstate" / "runc-path.cache").read_text().splitlines()
        assert cache[0].startswith(f"{installed}:") and cache[1] == tomllib.loads(installed.read_text())["runc"]
    finally:
        ctd.stop()

    _install("--uninstall", *args)
    assert main.read_bytes() == original and not (w / "conf.d").exists() and not installed.exists()
    assert "snapguard" not in _dump(CONTAINERD_16, main)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"].get(
        "runtimes", {})


# ---------------------------------------------------------------- containerd 2.1.9

@pytest.fixture
def lab_through_install(tmp_path: Path, root_only: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[crilab.CriLab]:
    """The lab's CRI containerd 2.1.9, its `snapguard` runtime taken out of the config it writes
    (the default runtime `runc` instead) and added back by `snapguard install`'s drop-in."""
    why = compat_missing()
    if why:
        pytest.skip(f"the compat stack is not installed: {why}")
    original = Containerd.write_config

    def write_config(self: Containerd) -> Path:
        config = original(self)
        handler = crilab.HANDLER
        text = (config.read_text()
                .replace(f"default_runtime_name = '{handler}'", "default_runtime_name = 'runc'")
                .replace(f"containerd.runtimes.{handler}", "containerd.runtimes.runc")
                .replace(f"BinaryName = '{snapguard_runc_path()}'", f"BinaryName = '{self.bin_dir}/runc'"))
        runtimes = tomllib.loads(text)["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
        assert list(runtimes) == ["runc"]
        config.write_text(text)
        _install("--containerd-config", str(config), "--containerd", f"{self.bin_dir}/containerd",
                 "--config", str(self.workdir / "snapguard.toml"), "--state-file", str(self.workdir / "install.json"),
                 "--snapguard-runc", snapguard_runc_path())
        return config

    monkeypatch.setattr(Containerd, "write_config", write_config)
    config = tmp_path / "snapguard-config.toml"  # SNAPGUARD_CONFIG of the shim's snapguard-runc
    config.write_text("")
    lab = crilab.CriLab(str(tmp_path / "lab"), str(config))
    try:
        lab.start()
        yield lab
    finally:
        lab.stop()


def test_containerd_2_loads_the_dropin_and_checkpoints_through_it(lab_through_install: crilab.CriLab) -> None:
    lab = lab_through_install
    assert lab.containerd is not None and lab.cri is not None
    w = lab.containerd.workdir
    main = w / "config.toml"
    dropin = tomllib.loads((w / "conf.d" / "99-snapguard.toml").read_text())
    assert dropin["version"] == 3 and list(dropin["plugins"]) == ["io.containerd.cri.v1.runtime"]
    runtimes = _dump(f"{lab.containerd.bin_dir}/containerd", main)["plugins"]["io.containerd.cri.v1.runtime"][
        "containerd"]["runtimes"]
    ours, runc = runtimes["snapguard"], runtimes["runc"]
    assert ours["options"]["BinaryName"] == os.path.realpath(snapguard_runc_path())
    assert (ours["runtime_path"], ours["sandboxer"], ours["options"]["Root"]) == \
        (runc["runtime_path"], runc["sandboxer"], runc["options"]["Root"])  # the default runtime's, kept
    assert tomllib.loads((w / "snapguard.toml").read_text())["runc"] == f"{lab.containerd.bin_dir}/runc"

    # a pod through the handler, a CRI checkpoint: snapguard-runc took it (its manifest is inside)
    lab.cri.pull(lab.counter_image)
    uid = str(uuid.uuid4())
    logs = w / "pods"
    logs.mkdir()
    sandbox = lab.cri.sandbox_config("install-pod", "default", uid, str(logs))
    pod = lab.cri.run_sandbox(sandbox)
    cid = lab.cri.create(pod, sandbox, lab.cri.container_config("counter", lab.counter_image, sandbox))
    lab.cri.start(cid)
    deadline = time.monotonic() + 20
    while len(lab.cri.exec_sync(cid, ["cat", "/out/counter.log"]).splitlines()) < 10:
        assert time.monotonic() < deadline, "the counter did not count"
        time.sleep(0.1)
    archive = w / "checkpoint.tar"
    lab.cri.checkpoint(cid, str(archive), timeout_s=60)
    with tarfile.open(archive) as tf:
        names = {m.name.rstrip("/") for m in tf.getmembers()}
    assert f"checkpoint/{MANIFEST_NAME}" in names

    _install("--uninstall", "--state-file", str(w / "install.json"))
    assert "snapguard" not in _dump(f"{lab.containerd.bin_dir}/containerd", main)["plugins"][
        "io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
