"""The node install profile and the Debian package, in fresh Debian chroots (debootstrap --variant=
minbase from Debian's archive, each suite once per session, made while the package builds).

Debian 12: packaging/profiles/node.sh bakes the package and the rig's snapguard-criu into the
chroot; no test-rig package (profiles/rig.sh's and criu.sh's lists), no compiler and no compat stack
is in it; CRIU 4.2.1 and its CUDA plugin are; the venv the postinst built runs `snapguard --version`,
the node preflight (exit 1, blocked: no GPU there, GPU_DRIVER_MISSING), the textfile metrics and
`import boto3, prometheus_client, grpc` (the s3, metrics and k8s extras); the agent's unit is
installed, not enabled; `snapguard install` with the node's default paths installs the launcher
built with the package (no compiler there) and it runs runc without Python; `dpkg --purge` reverses
it all and leaves nothing. Debian 13 (Python 3.13): the package installs with dpkg beside Debian's
python3 and the same commands work from its venv; the wheelhouse has CPython 3.10's tomli. arm64:
the cross-built launcher and wheel are aarch64 (the launcher's parser run under qemu-user-static).
Nothing on this machine is touched but the chroots (in a tmpfs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MIRROR = "http://deb.debian.org/debian"
# Debian 13's chroot comes with python3 (the package's one dependency), so its test installs the
# package with dpkg alone, no index update; Debian 12's gets everything through node.sh and apt
SUITES = {"bookworm": [], "trixie": ["--include=python3"]}
CRIU_DEBS = Path(os.environ.get("SNAPGUARD_DEBS", "/var/cache/snapguard-build/debs"))
# debootstrap's downloads, kept between sessions where the machine keeps them
DEBOOTSTRAP_CACHE = Path("/var/cache/snapguard-build/debootstrap")
ENV = ["/usr/bin/env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C", "DEBIAN_FRONTEND=noninteractive"]
VENV = "/opt/snapguard/venv"
LAUNCHER = f"{VENV}/bin/snapguard-runc-launcher"
WANTS = "/etc/systemd/system/multi-user.target.wants"
# on a node as well as on the rig: not test-rig packages
SHARED = {"python3", "ca-certificates", "curl", "xz-utils"}

pytestmark = pytest.mark.root


def _rig_packages() -> set[str]:
    """Every package the rig's profile installs (its lists in profiles/rig.sh and criu.sh)."""
    names: set[str] = set()
    for script in ("rig.sh", "criu.sh"):
        text = (REPO / "packaging" / "profiles" / script).read_text()
        for body in re.findall(r"^(?:RUNTIME|STORE|PACKAGING|SHELL|CROSS|CRIU_BUILD)_PKGS=\(([^)]*)\)", text, re.M):
            names.update(word.split("=")[0] for word in body.split())
    assert {"ceph-mon", "radosgw", "docker-registry", "build-essential", "containerd", "runc", "zsh",
            "qemu-user-static", "gcc-aarch64-linux-gnu"} <= names
    return names - SHARED


@dataclass
class Chroot:
    root: Path

    def run(self, *argv: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["chroot", str(self.root), *ENV, *argv], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def ok(self, *argv: str, timeout: float = 180) -> str:
        out = self.run(*argv, timeout=timeout)
        assert out.returncode == 0, f"{argv}: rc {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        return out.stdout

    def path(self, inside: str) -> Path:
        return self.root / inside.lstrip("/")

    def packages(self) -> set[str]:
        return set(self.ok("dpkg-query", "-W", "-f=${Package}\n").split())


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Chroot]]]:
    """The package (packaging/build-deb.sh) and one minbase chroot per suite, made at once."""
    if os.geteuid() != 0:
        pytest.fail("debootstrap and chroot need root (CI and the README's test command run as root)")
    if shutil.which("debootstrap") is None:
        pytest.fail("no debootstrap: run packaging/setup.sh (the rig profile installs it)")
    base = tmp_path_factory.mktemp("deb")
    DEBOOTSTRAP_CACHE.mkdir(parents=True, exist_ok=True)
    # the chroots in memory: dpkg's fsync of every file it unpacks is what makes them slow on disk
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4g,mode=0755", "snapguard-test-deb", str(base)],
                   check=True, timeout=30)
    try:
        yield from _build(base)
    finally:
        subprocess.run(["umount", "-l", str(base)], timeout=60)


def _build(base: Path) -> Iterator[tuple[Path, dict[str, Chroot]]]:
    jobs = {suite: subprocess.Popen(["debootstrap", "--variant=minbase", f"--cache-dir={DEBOOTSTRAP_CACHE}",
                                     *extra, suite, str(base / suite), MIRROR],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    text=True) for suite, extra in SUITES.items()}
    jobs["deb"] = subprocess.Popen(["bash", str(REPO / "packaging" / "build-deb.sh"), str(base / "dist")],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    outs: dict[str, tuple[int, str, str]] = {}
    try:
        for name, job in jobs.items():
            out, err = job.communicate(timeout=540)
            outs[name] = (job.returncode, out, err or "")
    finally:
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
                job.wait()
    for name, (rc, out, err) in outs.items():
        assert rc == 0, f"{name}: rc {rc}\n{out[-3000:]}\n{err[-3000:]}"
    deb = Path(outs["deb"][1].strip().splitlines()[-1])
    chroots = {suite: Chroot(base / suite) for suite in SUITES}
    mounted = []
    try:
        for chroot in chroots.values():
            subprocess.run(["mount", "-t", "proc", "proc", str(chroot.path("/proc"))], check=True, timeout=30)
            mounted.append(chroot.path("/proc"))
            chroot.path("/tmp/sg").mkdir()
            shutil.copy(deb, chroot.path("/tmp/sg"))
        yield deb, chroots
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", str(path)], timeout=30)


def _preflight_blocked_without_gpu(chroot: Chroot) -> dict:
    out = chroot.run("snapguard", "preflight", "--node", "--json", timeout=120)
    report = json.loads(out.stdout)
    assert out.returncode == 1 and report["exit_code"] == 1 and report["verdict"] == "blocked", out.stderr
    assert "GPU_DRIVER_MISSING" in [b["reason"] for b in report["capabilities"]["gpu"]["blockers"]]
    return report


def _venv_works(chroot: Chroot, python: str) -> None:
    assert chroot.ok("snapguard", "--version").strip() == "snapguard 0.1.0"
    assert chroot.ok(f"{VENV}/bin/python", "-c", "import sys; print('%d.%d' % sys.version_info[:2])").strip() == python
    chroot.ok(f"{VENV}/bin/python", "-I", "-c", "import boto3, prometheus_client, grpc, snapguard._procscan")
    # pip ran from its wheel: nothing of it (nor setuptools' .pth) is in the venv
    site = chroot.path(f"{VENV}/lib/python{python}/site-packages")
    assert not (site / "pip").exists() and not list(site.glob("*.pth")), sorted(os.listdir(site))
    for root, dirs, files in os.walk(chroot.path(VENV)):
        for name in dirs + files:
            st = os.lstat(os.path.join(root, name))
            assert os.path.islink(os.path.join(root, name)) or (st.st_uid == 0 and st.st_mode & 0o022 == 0), name


def _purge_leaves_nothing(chroot: Chroot) -> None:
    before = chroot.packages()
    out = chroot.run("dpkg", "--purge", "snapguard")
    assert out.returncode == 0, out.stdout + out.stderr
    # dpkg may only say that a directory the suite has besides the package's stays (/lib/systemd/system
    # where /lib is /usr/lib's alias)
    warnings = [line for line in (out.stdout + out.stderr).splitlines() if "warning" in line]
    kept = [m.group(1) if (m := re.search(r"directory '(.*)' not empty", w)) else w for w in warnings]
    assert [d for d in kept if "snapguard" in d or not chroot.path(d).is_dir()] == [], warnings
    assert chroot.packages() == before - {"snapguard"}
    assert [p for p in ("/opt/snapguard", "/etc/snapguard", "/var/lib/snapguard", "/usr/share/snapguard",
                        "/usr/bin/snapguard", f"{WANTS}/snapguard-preflight.service",
                        "/lib/systemd/system/snapguard-agent.service") if os.path.lexists(chroot.path(p))] == []


def test_node_profile_on_debian_12_has_nothing_of_the_rig(built: tuple[Path, dict[str, Chroot]]) -> None:
    deb, chroots = built
    chroot = chroots["bookworm"]
    criu_debs = sorted(CRIU_DEBS.glob("snapguard-criu_*_amd64.deb"))
    assert criu_debs, f"no snapguard-criu package in {CRIU_DEBS}: run packaging/setup.sh (profiles/criu.sh packs it)"
    shutil.copytree(REPO / "packaging" / "profiles", chroot.path("/tmp/sg/profiles"))
    shutil.copy(criu_debs[-1], chroot.path("/tmp/sg"))
    minbase = chroot.packages()
    chroot.ok("bash", "/tmp/sg/profiles/node.sh", f"/tmp/sg/{deb.name}", f"/tmp/sg/{criu_debs[-1].name}", timeout=300)

    installed = chroot.packages()
    assert {"snapguard", "snapguard-criu"} <= installed
    assert installed & _rig_packages() == set()
    assert [p for p in installed - minbase if p.endswith("-dev") or p.startswith(("gcc", "cpp", "ceph", "binutils"))] == []
    assert [p for p in ("/usr/bin/cc", "/usr/bin/gcc", "/opt/snapguard/compat") if os.path.lexists(chroot.path(p))] == []
    assert "Version: 4.2.1" in chroot.ok("/usr/local/sbin/criu", "--version")
    assert chroot.path("/usr/local/lib/criu/cuda_plugin.so").is_file()

    _venv_works(chroot, "3.11")
    report = _preflight_blocked_without_gpu(chroot)
    assert {c["name"]: c["status"] for c in report["checks"]}["cuda-plugin"] == "ok"
    chroot.ok("snapguard", "metrics", "--textfile", "/tmp/sg", timeout=120)
    assert 'snapguard_check_ok{check="criu"}' in chroot.path("/tmp/sg/snapguard.prom").read_text()
    assert "/etc/snapguard/config.toml" in chroot.ok("dpkg-query", "-W", "-f=${Conffiles}", "snapguard")
    assert chroot.path("/usr/share/bash-completion/completions/snapguard").read_text() == chroot.ok(
        "snapguard", "completion", "bash")
    assert chroot.path("/usr/share/zsh/vendor-completions/_snapguard").read_text() == chroot.ok(
        "snapguard", "completion", "zsh", "--autoload")
    # the boot units enabled, the agent's installed only (it runs once its sources and store are set)
    assert chroot.path(f"{WANTS}/snapguard-preflight.service").is_symlink()
    assert chroot.path(f"{WANTS}/snapguard-spill.service").is_symlink()
    agent = chroot.path("/lib/systemd/system/snapguard-agent.service").read_text()
    assert f"ExecStart={VENV}/bin/snapguard agent" in agent
    assert not os.path.lexists(chroot.path(f"{WANTS}/snapguard-agent.service"))

    # the node's own runc and containerd config, then `snapguard install` with the default paths:
    # the launcher built with the package, with no compiler here
    chroot.ok("apt-get", "install", "-y", "-qq", "--no-install-recommends", "runc", timeout=300)
    main = chroot.path("/etc/containerd/config.toml")
    main.parent.mkdir()
    main.write_text(original := 'version = 2\n\n[plugins."io.containerd.grpc.v1.cri".cni]\n  conf_dir = "/etc/cni/net.d"\n')
    ins = json.loads(chroot.ok("snapguard", "install", "--json"))
    assert ins["facts"]["binary_name"] == LAUNCHER
    dropin = tomllib.loads(chroot.path("/etc/containerd/conf.d/99-snapguard.toml").read_text())
    assert dropin["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["snapguard"]["options"][
        "BinaryName"] == LAUNCHER
    assert chroot.path(LAUNCHER).read_bytes() == chroot.path(f"{VENV}/share/snapguard/launcher/runc-launcher").read_bytes()
    st = os.stat(chroot.path(LAUNCHER))
    assert (st.st_mode & 0o7777, st.st_uid) == (0o755, 0)
    out = subprocess.run(["chroot", str(chroot.root), "/usr/bin/env", "-i", "PATH=/nonexistent", LAUNCHER, "--version"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "runc version" in out.stdout, out.stdout + out.stderr

    _purge_leaves_nothing(chroot)
    assert main.read_text() == original
    assert not chroot.path("/etc/containerd/conf.d").exists()


AARCH64_GCC = "/usr/bin/aarch64-linux-gnu-gcc"
QEMU_AARCH64 = "/usr/bin/qemu-aarch64-static"
EM_AARCH64 = 183


def _elf_machine(data: bytes) -> int:
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, data[:8]  # 64-bit little-endian
    return int.from_bytes(data[18:20], "little")


def test_the_arm64_cross_build_is_aarch64(tmp_path: Path) -> None:
    """What packaging/build-deb.sh --arch arm64 cross-builds, cheaply: the launcher (its parser run
    under qemu-user-static: checkpoint to snapguard, state to runc) and snapguard's wheel
    (packaging/build-wheel.sh: tagged linux_aarch64, its C helper an aarch64 ELF). The whole arm64
    package in an emulated Debian 12 chroot is packaging/check-arm64.sh's (too slow for the suite)."""
    from snapguard.install import DEFAULT_SNAPGUARD_CONFIG, build_launcher

    for tool in (AARCH64_GCC, QEMU_AARCH64):
        if not os.path.exists(tool):
            pytest.fail(f"no {tool}: run packaging/setup.sh (the rig profile installs the arm64 cross build)")
    launcher = build_launcher(DEFAULT_SNAPGUARD_CONFIG, cc=AARCH64_GCC)
    assert _elf_machine(launcher) == EM_AARCH64
    route = tmp_path / "route"
    route.write_bytes(build_launcher(DEFAULT_SNAPGUARD_CONFIG, cc=AARCH64_GCC, route_test=True))
    route.chmod(0o755)
    assert _elf_machine(route.read_bytes()) == EM_AARCH64
    for argv, want in ((["checkpoint", "c1"], "snapguard"), (["--root", "/r", "state", "c1"], "runc"),
                       (["--bogus", "restore"], "snapguard")):
        out = subprocess.run([QEMU_AARCH64, "-L", "/usr/aarch64-linux-gnu", str(route), *argv], capture_output=True,
                             text=True, timeout=60)
        assert (out.returncode, out.stdout.strip()) == (0, want), (argv, out)
    out = subprocess.run(["bash", str(REPO / "packaging" / "build-wheel.sh"), "--arch", "arm64", str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-3000:]
    wheel = Path(out.stdout.strip().splitlines()[-1])
    assert wheel.name.endswith("-cp310-abi3-linux_aarch64.whl"), wheel.name
    with zipfile.ZipFile(wheel) as z:
        helpers = [n for n in z.namelist() if n.startswith("snapguard/_procscan") and n.endswith(".so")]
        assert helpers == ["snapguard/_procscan.abi3.so"], z.namelist()
        assert _elf_machine(z.read(helpers[0])) == EM_AARCH64


def test_package_on_debian_13_python_3_13(built: tuple[Path, dict[str, Chroot]]) -> None:
    deb, chroots = built
    chroot = chroots["trixie"]
    minbase = chroot.packages()
    chroot.ok("dpkg", "-i", f"/tmp/sg/{deb.name}", timeout=300)
    installed = chroot.packages()
    assert "snapguard" in installed and installed & _rig_packages() == set()
    _venv_works(chroot, "3.13")
    report = _preflight_blocked_without_gpu(chroot)
    assert "CRIU_MISSING" in [b["reason"] for b in report["blockers"]]
    assert chroot.path(f"{VENV}/share/snapguard/launcher/runc-launcher").is_file()
    # CPython 3.10's own requirement (tomli, behind a python_version marker pip download leaves out)
    assert list(chroot.path("/usr/share/snapguard/wheels").glob("tomli-*-py3-none-any.whl"))
    _purge_leaves_nothing(chroot)
    assert minbase <= chroot.packages()
