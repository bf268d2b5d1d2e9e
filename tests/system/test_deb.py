"""The Debian package for node images (packaging/build-deb.sh, dh-virtualenv): it builds, installs
with dpkg on this machine, runs from its own venv (/opt/snapguard/venv: `snapguard --version`, the
node preflight as Prometheus textfile metrics, `snapguard install` building the pass-through launcher
from the sources the package carries and naming it, where a compiler exists, else naming its
snapguard-runc), and `dpkg --purge` leaves nothing behind, what `snapguard install` wrote included
(the launcher too: the package's prerm reverses it). It touches none of the test suite's own files: the package's paths are its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from snapguard.trust import resolve_trusted
from tests.launcher_compiler import pinned_compiler_usable

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ["/opt/snapguard/venv", "/etc/snapguard", "/var/lib/snapguard"]
ENABLED = [path for unit in ("snapguard-preflight.service", "snapguard-spill.service")
           for path in (f"/etc/systemd/system/multi-user.target.wants/{unit}",
                        f"/var/lib/systemd/deb-systemd-helper-enabled/{unit}.dsh-also",
                        f"/var/lib/systemd/deb-systemd-helper-enabled/multi-user.target.wants/{unit}")]


LAUNCHER = "/opt/snapguard/venv/bin/snapguard-runc-launcher"


def _installed() -> str:
    out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", "snapguard"], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else ""


def _run(*cmd: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)


@pytest.fixture(scope="module")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.geteuid() != 0:
        pytest.fail("dpkg -i needs root (CI and the README's test command run as root)")
    if _installed() or any(os.path.exists(p) for p in PACKAGE_DIRS):
        pytest.skip("this machine has a snapguard package or its directories: the test would replace them")
    out = tmp_path_factory.mktemp("deb")
    built = _run("bash", str(REPO / "packaging" / "build-deb.sh"), str(out), timeout=540)
    assert built.returncode == 0, built.stderr[-3000:]
    return Path(built.stdout.strip().splitlines()[-1])


def test_package_installs_runs_and_purges_cleanly(deb: Path, tmp_path: Path) -> None:
    listing = _run("dpkg-deb", "-c", str(deb)).stdout.splitlines()
    paths = [line.split(None, 5)[5].split(" -> ")[0].lstrip(".").rstrip("/") or "/" for line in listing]
    assert {"/opt/snapguard/venv/bin/snapguard-runc", "/usr/bin/snapguard", "/usr/bin/snapguard-runc",
            "/etc/snapguard/config.toml", "/lib/systemd/system/snapguard-preflight.service",
            "/lib/systemd/system/snapguard-spill.service"} <= set(paths)
    site = next(p for p in paths if p.endswith("/site-packages"))
    assert {f"{site}/snapguard/takepoint/site/sitecustomize.py", f"{site}/snapguard/_procscan.abi3.so",
            f"{site}/prometheus_client/__init__.py", f"{site}/snapguard/_c_helpers/runc_launcher.c",
            f"{site}/snapguard/_c_helpers/runc_argv_table.h"} <= set(paths)
    assert not any("distutils-precedence.pth" in p for p in paths)  # nothing runs at every start
    existed = {p for p in paths if os.path.lexists(p)}

    # what `snapguard install` will change: a node's containerd config, in a temporary tree
    etc = tmp_path / "etc"
    (etc / "containerd").mkdir(parents=True)
    main = etc / "containerd" / "config.toml"
    main.write_text('version = 2\n\n[plugins."io.containerd.grpc.v1.cri".cni]\n  conf_dir = "/etc/cni/net.d"\n')
    before = {p: p.read_bytes() for p in etc.rglob("*") if p.is_file()}

    try:
        inst = _run("dpkg", "-i", str(deb))
        assert inst.returncode == 0, inst.stdout[-2000:] + inst.stderr[-2000:]
        assert _installed() == "install ok installed"
        conffiles = _run("dpkg-query", "-W", "-f=${Conffiles}", "snapguard").stdout
        assert "/etc/snapguard/config.toml" in conffiles

        version = _run("/usr/bin/snapguard", "--version", env={"PATH": "/usr/bin:/bin"})
        assert version.stdout.strip() == "snapguard 0.1.0", version.stderr
        # everything that decides what runs as root is root's alone (snapguard.trust's rules)
        assert resolve_trusted("/usr/bin/snapguard-runc", "exec") == "/opt/snapguard/venv/bin/snapguard-runc"
        for root, dirs, files in os.walk("/opt/snapguard/venv"):
            for name in dirs + files:
                st = os.lstat(os.path.join(root, name))
                assert st.st_uid == 0 and st.st_mode & 0o022 == 0 or os.path.islink(os.path.join(root, name)), name
        imported = _run("/opt/snapguard/venv/bin/python", "-c",
                        "import snapguard, snapguard._procscan, prometheus_client; print(snapguard.__file__)", cwd="/")
        assert imported.stdout.startswith(site), imported.stderr

        # the boot unit's command: the node preflight as textfile metrics
        metrics = _run("/usr/bin/snapguard", "metrics", "--textfile", str(tmp_path), timeout=180)
        assert metrics.returncode == 0, metrics.stderr
        prom = (tmp_path / "snapguard.prom").read_text()
        assert "snapguard_node_ready" in prom and 'snapguard_check_ok{check="criu"}' in prom
        unit = Path("/lib/systemd/system/snapguard-preflight.service").read_text()
        assert "ExecStart=/opt/snapguard/venv/bin/snapguard metrics" in unit and "Type=oneshot" in unit
        # the spill tmpfs, with huge pages, at the path the take points look for; both units
        # enabled for the next boot, neither started by the install
        spill = Path("/lib/systemd/system/snapguard-spill.service").read_text()
        assert re.search(r"^ExecStart=/bin/mount -t tmpfs -o \S*huge=within_size\S* snapguard-spill "
                         r"/run/snapguard-spill$", spill, re.M), spill
        assert [p for p in ENABLED if p.startswith("/etc/") and not os.path.lexists(p)] == []

        # `snapguard install` from the package builds the launcher from the package's sources (with
        # the pinned compiler, where there is one) beside the package's snapguard-runc and names it,
        # else (--no-launcher) names the package's snapguard-runc; the state file is the default
        # one, which the package's prerm reads
        conf = tmp_path / "snapguard.toml"
        compiler = pinned_compiler_usable()
        ins = _run("/usr/bin/snapguard", "install", "--containerd-config", str(main), "--config", str(conf), "--json",
                   *([] if compiler else ["--no-launcher"]))
        assert ins.returncode == 0, ins.stderr
        expected = LAUNCHER if compiler else "/opt/snapguard/venv/bin/snapguard-runc"
        assert json.loads(ins.stdout)["facts"]["binary_name"] == expected
        dropin = tomllib.loads((etc / "containerd" / "conf.d" / "99-snapguard.toml").read_text())
        runtime = dropin["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["snapguard"]
        assert runtime["options"]["BinaryName"] == expected
        if compiler:
            st = os.stat(LAUNCHER)
            assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o755, 0, 0)
            assert (tmp_path / "runc-launcher.pin").is_file()
            # runc's own --version, through the launcher, without Python
            ver = _run(LAUNCHER, "--version", env={"PATH": "/nonexistent"})
            assert ver.returncode == 0 and "runc version" in ver.stdout, ver.stdout + ver.stderr
        assert os.path.exists("/var/lib/snapguard/install.json")
    finally:
        purge = _run("dpkg", "--purge", "snapguard")
    assert purge.returncode == 0, purge.stdout[-2000:] + purge.stderr[-2000:]
    # dpkg may only say that a directory it shares with what was there before stays (/opt/snapguard
    # holds the compat stack where install-deps.sh put one)
    warnings = [line for line in (purge.stdout + purge.stderr).splitlines() if "warning" in line]
    assert [w for w in warnings if not (re.search(r"directory '(.*)' not empty", w) and
                                        re.search(r"directory '(.*)' not empty", w).group(1) in existed)] == []
    assert _installed() == ""
    left = sorted(p for p in paths if os.path.lexists(p) and p not in existed)
    assert left == []
    assert [p for p in PACKAGE_DIRS + ENABLED if os.path.lexists(p)] == []
    # the prerm reversed what `snapguard install` wrote
    assert {p: p.read_bytes() for p in etc.rglob("*") if p.is_file()} == before
    assert not (etc / "containerd" / "conf.d").exists() and not conf.exists()
    assert not os.path.lexists(LAUNCHER) and not (tmp_path / "runc-launcher.pin").exists()
