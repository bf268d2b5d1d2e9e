"""`snapguard install` writing a node's files on temporary trees, which needs root: the drop-in
per containerd version, the main config's imports, snapguard's config with pinned paths, NVIDIA's
runtime as the default, --uninstall, another runtime name and the launcher. The plans themselves
(--dry-run, refusals) are in tests/unit/test_install.py, whose node fixture these share."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from snapguard import install
from snapguard.config import DEFAULTS, load
from snapguard.reasons import SnapguardError
from tests.unit.test_install import DEBIAN_12_CONFIG, SNAPGUARD, SNAPGUARD_RUNC, Node, _exe, _toml, node

pytestmark = pytest.mark.root

__all__ = ["node"]  # the shared fixture


NVIDIA_V2_CONFIG = """# managed by nvidia-ctk
version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.9"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "nvidia"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
          BinaryName = "{nvidia}"
          SystemdCgroup = true
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = true
"""


def _pin(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines()
    assert lines[0] == "snapguard-runc-launcher 1"
    return dict(line.partition(" ")[::2] for line in lines[1:])


def test_containerd_16_with_debians_config(node: Node) -> None:
    node.main.parent.mkdir(parents=True)
    node.main.write_text(DEBIAN_12_CONFIG)
    before = node.snapshot()
    plan = node.install()
    assert plan.facts["config_version"] == 2 and plan.facts["containerd_version"] == "1.6.20~ds1"
    assert {c.path: c.action for c in plan.changes} == {
        str(node.dropin): "create", str(node.main): "edit", str(node.config): "create"}

    # containerd 1.x replaces the CRI plugin's whole table: the drop-in carries the main config's
    dropin = _toml(node.dropin)
    cri = dropin["plugins"]["io.containerd.grpc.v1.cri"]
    assert dropin["version"] == 2 and cri["cni"] == {"bin_dir": "/usr/lib/cni", "conf_dir": "/etc/cni/net.d"}
    assert cri["containerd"]["runtimes"]["snapguard"] == {
        "runtime_type": "io.containerd.runc.v2", "options": {"BinaryName": os.path.realpath(SNAPGUARD_RUNC)},
        "pod_annotations": ["snapguard.io/*"]}  # what `snapguard agent --containerd` reads
    assert "io.containerd.internal.v1.opt" not in dropin["plugins"]  # only the CRI plugin's table

    # the main config: one line more, the rest byte for byte
    main = node.main.read_text()
    assert main == DEBIAN_12_CONFIG.replace("version = 2\n", f'version = 2\nimports = ["{node.dropin}"]\n', 1)

    config = _toml(node.config)
    assert config["runc"] == str(node.runc) and config["criu"] == str(node.criu)
    assert config["criu_libdir"] == str(node.libdir) and config["cuda_checkpoint"] == "/usr/local/bin/cuda-checkpoint"
    assert load({"SNAPGUARD_CONFIG": str(node.config)}).runc == str(node.runc)  # snapguard reads it
    # a switch (or the agent's string) at its default is not written: an older snapguard, which
    # refuses keys it does not know, still reads the file, and the plan still shows it
    for switch in install.UNWRITTEN_DEFAULTS:
        assert switch not in config and plan.facts["config"][switch]["value"] == DEFAULTS[switch]
    for path, mode in ((node.dropin, 0o644), (node.main, 0o644), (node.config, 0o644), (node.state, 0o600)):
        st = os.stat(path)
        assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (mode, 0, 0), path
    assert os.stat(node.state.parent).st_mode & 0o777 == 0o700

    # a second run changes nothing, not even a timestamp
    written = node.snapshot()
    again = node.install()
    assert not again.changed and {c.action for c in again.changes} == {"unchanged"}
    assert node.snapshot() == written

    # --uninstall puts everything back as it was
    undo = node.uninstall()
    assert {c.path: c.action for c in undo.changes} == {
        str(node.dropin): "remove", str(node.main): "edit", str(node.config): "remove"}
    assert {p: v[0] for p, v in node.snapshot().items()} == {p: v[0] for p, v in before.items()}
    assert not node.uninstall().changed  # and a second --uninstall has nothing to do


def test_containerd_2_without_a_main_config(tmp_path: Path) -> None:
    node = Node(tmp_path, "2.1.9+unknown")
    before = node.snapshot()
    plan = node.install()
    assert plan.facts["config_version"] == 3 and plan.facts["config_version_from"] == "containerd 2.1.9+unknown"
    assert _toml(node.main) == {"version": 3, "imports": [str(node.dropin)]}
    # containerd 2.x merges tables key by key: the runtime alone
    assert _toml(node.dropin) == {"version": 3, "plugins": {"io.containerd.cri.v1.runtime": {"containerd": {
        "runtimes": {"snapguard": {"runtime_type": "io.containerd.runc.v2", "pod_annotations": ["snapguard.io/*"],
                                   "options": {"BinaryName": os.path.realpath(SNAPGUARD_RUNC)}}}}}}}
    assert not node.install().changed
    node.uninstall()
    assert set(node.snapshot()) == set(before)  # the directories it made are gone too


def test_version_3_main_config_whose_imports_cover_conf_d(tmp_path: Path) -> None:
    node = Node(tmp_path, "2.2.0")
    node.main.parent.mkdir(parents=True)
    text = ("version = 3\nimports = ['/nowhere/*.toml', 'conf.d/*.toml']  # drop-ins\n\n"
            "[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]\n  runtime_path = '/opt/x/shim'\n"
            "[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]\n  SystemdCgroup = true\n")
    node.main.write_text(text)
    plan = node.install()
    assert {c.path: c.action for c in plan.changes}[str(node.main)] == "unchanged"
    assert node.main.read_text() == text
    runtime = _toml(node.dropin)["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["snapguard"]
    assert runtime == {"runtime_type": "io.containerd.runc.v2", "runtime_path": "/opt/x/shim",  # the default's
                       "options": {"SystemdCgroup": True, "BinaryName": os.path.realpath(SNAPGUARD_RUNC)},
                       "pod_annotations": ["snapguard.io/*"]}
    node.uninstall()
    assert node.main.read_text() == text and not node.dropin.exists()


def test_nvidia_default_runtime_is_snapguards_runc(node: Node) -> None:
    node.main.parent.mkdir(parents=True)
    node.main.write_text(NVIDIA_V2_CONFIG.format(nvidia=node.nvidia))
    node.config.parent.mkdir(parents=True)
    previous = '# the site\'s own\nrunc = "/usr/sbin/runc"\ntake_wait_s = 20\n'
    node.config.write_text(previous)
    plan = node.install()
    assert plan.facts["default_runtime"] == {"name": "nvidia", "binary": str(node.nvidia), "nvidia": True,
                                             "systemd_cgroup": True}
    config = _toml(node.config)
    assert config["runc"] == str(node.nvidia)  # GPU containers keep their devices
    assert config["take_wait_s"] == 20  # what the site set is kept
    assert not set(install.UNWRITTEN_DEFAULTS) & set(config)  # an older install's file gains no key it did not have
    assert any("replaced by NVIDIA's" in n for n in plan.notes)
    cri = _toml(node.dropin)["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "registry.k8s.io/pause:3.9" and cri["containerd"]["default_runtime_name"] == "nvidia"
    assert set(cri["containerd"]["runtimes"]) == {"nvidia", "runc", "snapguard"}
    assert cri["containerd"]["runtimes"]["snapguard"]["options"] == {
        "BinaryName": os.path.realpath(SNAPGUARD_RUNC), "SystemdCgroup": True}
    assert not node.install().changed
    node.uninstall()
    assert node.config.read_text() == previous  # the file it replaced is back


def test_a_switch_the_site_set_is_kept(node: Node) -> None:
    node.main.parent.mkdir(parents=True)
    node.main.write_text(DEBIAN_12_CONFIG)
    node.config.parent.mkdir(parents=True)
    node.config.write_text("cuda_broker = false\n")
    plan = node.install()
    assert _toml(node.config)["cuda_broker"] is False
    assert plan.facts["config"]["cuda_broker"] == {"value": False, "source": f"kept from {node.config}"}
    assert load({"SNAPGUARD_CONFIG": str(node.config)}).cuda_broker is False


def test_cli_install_then_uninstall(node: Node) -> None:
    node.main.parent.mkdir(parents=True)
    node.main.write_text(DEBIAN_12_CONFIG)
    args = ["--containerd-config", str(node.main), "--config", str(node.config), "--state-file", str(node.state),
            "--containerd", str(node.containerd)]
    out = subprocess.run([SNAPGUARD, "install", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "restart containerd" in out.stdout and node.dropin.exists()
    again = subprocess.run([SNAPGUARD, "install", *args], capture_output=True, text=True, timeout=60)
    assert "nothing to change" in again.stdout
    undo = subprocess.run([SNAPGUARD, "install", "--uninstall", *args], capture_output=True, text=True, timeout=60)
    assert undo.returncode == 0 and "remove" in undo.stdout and not node.dropin.exists()
    assert node.main.read_text() == DEBIAN_12_CONFIG


def test_a_changed_dropin_is_kept_by_uninstall(node: Node) -> None:
    node.install()
    node.dropin.write_text(node.dropin.read_text() + "# edited\n")
    plan = node.uninstall()
    assert {c.path: c.action for c in plan.changes}[str(node.dropin)] == "keep"
    assert node.dropin.exists() and not node.main.exists() and not node.state.exists()


def test_another_runtime_name(node: Node) -> None:
    node.install(runtime_name="snapguard-gpu")
    dropin = node.dropin.parent / "99-snapguard-gpu.toml"
    assert "snapguard-gpu" in _toml(dropin)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    with pytest.raises(SnapguardError, match="uninstall"):
        install.plan_install(node.options())


def test_the_launcher_is_built_installed_and_pinned(node: Node) -> None:
    node.main.parent.mkdir(parents=True)
    node.main.write_text(DEBIAN_12_CONFIG)
    node.runc.write_text("#!/bin/sh\necho \"fake runc $*\"\n")
    launcher = node.tmp / "libexec" / "snapguard-runc"
    pin_path = node.config.parent / "runc-launcher.pin"
    before = node.snapshot()
    plan = node.install(launcher=True, launcher_path=str(launcher))
    assert {c.path: c.action for c in plan.changes} == {
        str(node.dropin): "create", str(node.main): "edit", str(node.config): "create",
        str(launcher): "create", str(pin_path): "create"}
    assert plan.facts["binary_name"] == plan.facts["launcher"] == str(launcher)
    runtime = _toml(node.dropin)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["snapguard"]
    assert runtime["options"] == {"BinaryName": str(launcher)}  # containerd runs the launcher
    for path, mode in ((launcher, 0o755), (pin_path, 0o644)):
        st = os.stat(path)
        assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (mode, 0, 0), path
    st = os.stat(node.config)
    assert _pin(pin_path) == {"config": str(node.config), "runc": str(node.runc),
                              "entry": os.path.realpath(SNAPGUARD_RUNC),
                              "stamp": f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"}
    env = {"PATH": "/nonexistent", "SNAPGUARD_CONFIG": str(node.config), "SNAPGUARD_STATE_DIR": str(node.tmp / "run")}
    out = subprocess.run([launcher, "--root", "/r", "state", "c1"], env=env, capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout, out.stderr) == (0, "fake runc --root /r state c1\n", "")

    # a second run changes nothing, not even a timestamp
    written = node.snapshot()
    assert not node.install(launcher=True, launcher_path=str(launcher)).changed
    assert node.snapshot() == written

    # the config loader keeps the pinned file in sync with the config's runc
    other = _exe(node.bin / "other-runc", "#!/bin/sh\necho \"other runc $*\"\n")
    node.config.write_text(node.config.read_text().replace(str(node.runc), str(other)))
    # the config changed since the pin: the launcher hands over to the Python entry, which reads it
    # (and refreshes the pinned file), so the runc run is the config's new one
    out = subprocess.run([launcher, "state", "c1"], env=env, capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout) == (0, "other runc state c1\n")
    assert _pin(pin_path)["runc"] == str(other)
    out = subprocess.run([launcher, "state", "c1"], env=env, capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout) == (0, "other runc state c1\n")
    # and load(), as checkpoint and restore read the config, does the same
    node.config.write_text(written[str(node.config)][0].decode())  # the config as install wrote it
    assert load({"SNAPGUARD_CONFIG": str(node.config)}).runc == str(node.runc)
    st = os.stat(node.config)
    assert _pin(pin_path)["runc"] == str(node.runc)
    assert _pin(pin_path)["stamp"] == f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"

    # --uninstall removes both (the pinned file whatever the loader wrote into it)
    other.unlink()
    undo = node.uninstall()
    assert {c.path: c.action for c in undo.changes}[str(launcher)] == "remove"
    assert {c.path: c.action for c in undo.changes}[str(pin_path)] == "remove"
    after = {p: v[0] for p, v in node.snapshot().items() if not p.startswith(str(node.tmp / "run"))}
    assert after == {p: v[0] for p, v in before.items()}


def test_dropping_the_launcher_removes_it(node: Node) -> None:
    launcher = node.tmp / "libexec" / "snapguard-runc"
    node.install(launcher=True, launcher_path=str(launcher))
    plan = node.install(launcher=False)
    assert {c.path: c.action for c in plan.changes}[str(launcher)] == "remove"
    assert not launcher.exists() and not (node.config.parent / "runc-launcher.pin").exists()
    runtime = _toml(node.dropin)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["snapguard"]
    assert runtime["options"]["BinaryName"] == os.path.realpath(SNAPGUARD_RUNC)


def test_cli_launcher_flags_build_install_and_drop_it(node: Node) -> None:
    """The flags through the installed `snapguard` command: --launcher with a path and the pinned
    compiler builds it there and makes it BinaryName; --no-launcher takes it out again; a compiler
    that is not there fails the run, with nothing written."""
    node.main.parent.mkdir(parents=True)
    node.main.write_text(DEBIAN_12_CONFIG)
    node.runc.write_text("#!/bin/sh\necho \"fake runc $*\"\n")
    launcher = node.tmp / "libexec" / "runc-launcher"
    args = ["--containerd-config", str(node.main), "--config", str(node.config), "--state-file", str(node.state),
            "--containerd", str(node.containerd)]

    def binary_name() -> str:
        return _toml(node.dropin)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["snapguard"][
            "options"]["BinaryName"]

    before = node.snapshot()
    missing = subprocess.run([SNAPGUARD, "install", *args, "--launcher", "--launcher-path", str(launcher),
                              "--cc", str(node.tmp / "no-cc")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no C compiler at" in missing.stderr, missing.stderr
    assert node.snapshot() == before

    out = subprocess.run([SNAPGUARD, "install", *args, "--launcher", "--launcher-path", str(launcher),
                          "--cc", install.DEFAULT_CC, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["facts"]["binary_name"] == str(launcher) == binary_name()
    st = os.stat(launcher)
    assert (st.st_mode & 0o7777, st.st_uid) == (0o755, 0)
    assert (node.config.parent / "runc-launcher.pin").exists()

    dropped = subprocess.run([SNAPGUARD, "install", *args, "--no-launcher"], capture_output=True, text=True,
                             timeout=120)
    assert dropped.returncode == 0, dropped.stderr
    assert not launcher.exists() and not (node.config.parent / "runc-launcher.pin").exists()
    assert binary_name() == os.path.realpath(SNAPGUARD_RUNC)


def test_store_is_given_to_containerd_through_a_systemd_dropin(node: Node) -> None:
    """--store writes SNAPGUARD_STORE into a drop-in for containerd's unit (the pod fence reads it
    from containerd's environment): a daemon-reload among the next steps, unchanged on a second
    run, kept by a run without --store, removed by --uninstall; without any, the next steps
    (printed and --json's `next`) say containerd needs it."""
    units = node.etc / "systemd" / "system" / "containerd.service.d"
    plan = node.install(systemd_dir=str(units))
    assert any("SNAPGUARD_STORE" in s and "--store" in s for s in plan.to_dict()["next"])
    dropin = units / "snapguard-store.conf"
    assert not dropin.exists()
    plan = node.install(store="s3://snaps/train%2Fa", systemd_dir=str(units))
    text = dropin.read_text()
    assert '[Service]\nEnvironment="SNAPGUARD_STORE=s3://snaps/train%%2Fa"\n' in text and os.stat(dropin).st_uid == 0
    steps = plan.to_dict()["next"]
    assert steps[0].startswith("systemctl daemon-reload") and steps[1].startswith("systemctl restart containerd")
    assert not any("SNAPGUARD_STORE=<store URL>" in s for s in steps) and any("S3_ENDPOINT_URL" in s for s in steps)
    assert "next:\n  1. systemctl daemon-reload" in plan.to_text(False)
    again = node.install(store="s3://snaps/train%2Fa", systemd_dir=str(units))
    assert not again.changed and not any(s.startswith("systemctl") for s in again.next_steps())
    kept = node.install(systemd_dir=str(units))
    assert not kept.changed and dropin.read_text() == text
    assert kept.facts["store"] == {"url": None, "dropin": str(dropin)}
    undo = node.uninstall(systemd_dir=str(units))
    assert {c.path: c.action for c in undo.changes}[str(dropin)] == "remove" and not dropin.exists()
    assert not units.exists() and undo.next_steps()[0].startswith("systemctl daemon-reload")
