"""`snapguard install` on temporary trees: config version detection, the drop-in's shape per
containerd version, the main config's imports, snapguard's config with pinned paths, NVIDIA's
runtime as the default, idempotence, --dry-run and --uninstall. What writes the files (which
needs root) is in tests/system/test_root_install.py; a real containerd loads the drop-in in
tests/system/test_install_containerd.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from snapguard import install
from snapguard.reasons import Reason, SnapguardError

REPO = Path(__file__).resolve().parents[2]
SNAPGUARD = os.path.join(os.path.dirname(sys.executable), "snapguard")
SNAPGUARD_RUNC = os.path.join(os.path.dirname(sys.executable), "snapguard-runc")

DEBIAN_12_CONFIG = """version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
"""

def _exe(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


class Node:
    """A node's files under tmp: containerd's config dir, snapguard's, the state, fake binaries."""

    def __init__(self, tmp: Path, containerd_version: str = "1.6.20~ds1") -> None:
        self.tmp = tmp
        self.etc = tmp / "etc"
        self.main = self.etc / "containerd" / "config.toml"
        self.dropin = self.etc / "containerd" / "conf.d" / "99-snapguard.toml"
        self.config = self.etc / "snapguard" / "config.toml"
        self.state = tmp / "var" / "lib" / "snapguard" / "install.json"
        self.state.parent.parent.mkdir(parents=True)  # /var/lib is there on any node
        self.bin = tmp / "bin"
        module = "github.com/containerd/containerd" + ("/v2" if containerd_version.startswith("2") else "")
        self.containerd = _exe(self.bin / "containerd",
                               f"#!/bin/sh\necho 'containerd {module} {containerd_version} deadbeef'\n")
        self.runc = _exe(self.bin / "runc")
        self.criu = _exe(self.bin / "criu")
        self.libdir = self.tmp / "lib" / "criu"
        self.libdir.mkdir(parents=True)
        self.nvidia = _exe(self.bin / "nvidia-container-runtime")

    def options(self, **kw: object) -> install.Options:
        base = dict(containerd_config=str(self.main), snapguard_config=str(self.config), state_file=str(self.state),
                    containerd=str(self.containerd), snapguard_runc=SNAPGUARD_RUNC,
                    candidates={"runc": (str(self.runc),), "criu": (str(self.criu),),
                                "criu_libdir": (str(self.libdir),), "cuda_checkpoint": (str(self.bin / "nope"),)})
        base.update(kw)
        return install.Options(**base)  # type: ignore[arg-type]

    def install(self, **kw: object) -> install.Plan:
        plan = install.plan_install(self.options(**kw))
        install.apply(plan)
        return plan

    def uninstall(self, **kw: object) -> install.Plan:
        plan = install.plan_uninstall(self.options(**kw))
        install.apply(plan)
        return plan

    def snapshot(self) -> dict[str, tuple[bytes | None, int]]:
        """Every file and directory under tmp with its bytes (None: a directory) and mtime."""
        out: dict[str, tuple[bytes | None, int]] = {}
        for root, dirs, files in os.walk(self.tmp):
            for d in dirs:
                out[os.path.join(root, d)] = (None, 0)
            for f in files:
                p = os.path.join(root, f)
                out[p] = (Path(p).read_bytes(), os.stat(p).st_mtime_ns)
        return out


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def _toml(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def test_dry_run_writes_nothing_and_shows_the_diff(node: Node) -> None:
    node.main.parent.mkdir(parents=True)
    node.main.write_text(DEBIAN_12_CONFIG)
    before = node.snapshot()
    out = subprocess.run([SNAPGUARD, "install", "--dry-run", "--containerd-config", str(node.main),
                          "--config", str(node.config), "--state-file", str(node.state),
                          "--containerd", str(node.containerd)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert node.snapshot() == before
    assert f"would create   {node.dropin}" in out.stdout and f"would edit     {node.main}" in out.stdout
    assert f'+imports = ["{node.dropin}"]' in out.stdout
    assert "nothing written (--dry-run)" in out.stdout
    assert "kind: RuntimeClass" in out.stdout and "handler: snapguard" in out.stdout
    js = subprocess.run([SNAPGUARD, "install", "--dry-run", "--json", "--containerd-config", str(node.main),
                         "--config", str(node.config), "--state-file", str(node.state),
                         "--containerd", str(node.containerd)], capture_output=True, text=True, timeout=60)
    plan = json.loads(js.stdout)
    assert plan["changed"] and plan["facts"]["config_version"] == 2 and "handler: snapguard" in plan["runtimeclass"]


def test_a_foreign_dropin_is_not_overwritten(node: Node) -> None:
    node.dropin.parent.mkdir(parents=True)
    node.dropin.write_text("# someone else's\n")
    with pytest.raises(SnapguardError, match="not written by snapguard install"):
        install.plan_install(node.options())
    assert node.dropin.read_text() == "# someone else's\n"


def test_a_later_import_replacing_the_cri_table_is_refused_on_containerd_1(node: Node) -> None:
    node.main.parent.mkdir(parents=True)
    node.main.write_text('version = 2\nimports = ["conf.d/*.toml"]\n')
    later = node.dropin.parent / "zz-site.toml"
    later.parent.mkdir(parents=True)
    later.write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "x"\n')
    with pytest.raises(SnapguardError, match="zz-site.toml is imported after"):
        install.plan_install(node.options())
    # one that loads before is folded into the drop-in's copy
    later.rename(later.parent / "10-site.toml")
    plan = install.plan_install(node.options())
    assert "sandbox_image = \"x\"" in next(c for c in plan.changes if c.path == str(node.dropin)).after.decode()


def test_version_1_main_config_is_refused(node: Node) -> None:
    node.main.parent.mkdir(parents=True)
    node.main.write_text('[plugins.cri]\n  sandbox_image = "x"\n')
    with pytest.raises(SnapguardError, match="sets no `version`") as e:
        install.plan_install(node.options())
    assert e.value.reason is Reason.USAGE_ERROR


def test_a_main_config_others_can_write_is_refused(node: Node) -> None:
    node.main.parent.mkdir(parents=True)
    node.main.write_text(DEBIAN_12_CONFIG)
    node.main.chmod(0o666)
    with pytest.raises(SnapguardError) as e:
        install.plan_install(node.options())
    assert e.value.reason is Reason.UNTRUSTED_PATH


def test_runtime_name_must_be_a_handler_name(node: Node) -> None:
    with pytest.raises(SnapguardError, match="DNS label"):
        install.plan_install(node.options(runtime_name="Snap_Guard"))


# --- snapguard-runc's C launcher


def test_the_launcher_needs_the_pinned_compiler(node: Node) -> None:
    before = node.snapshot()
    with pytest.raises(install.CompilerMissingError, match="no C compiler at") as e:
        install.plan_install(node.options(launcher=True, launcher_path=str(node.tmp / "l"), cc=str(node.tmp / "no-cc")))
    assert e.value.reason is Reason.USAGE_ERROR
    assert node.snapshot() == before


def test_a_foreign_file_at_the_launchers_path_is_not_overwritten(node: Node) -> None:
    launcher = _exe(node.tmp / "libexec" / "snapguard-runc", "#!/bin/sh\n# someone else's\n")
    with pytest.raises(SnapguardError, match="not written by snapguard install"):
        install.plan_install(node.options(launcher=True, launcher_path=str(launcher)))
    assert launcher.read_text() == "#!/bin/sh\n# someone else's\n"


# --- the CLI's launcher flags ---------------------------------------------------------------------

@pytest.mark.parametrize("flags, expected", [
    ([], {"launcher": None, "launcher_path": None, "cc": install.DEFAULT_CC}),
    (["--launcher"], {"launcher": True, "launcher_path": None, "cc": install.DEFAULT_CC}),
    (["--no-launcher"], {"launcher": False, "launcher_path": None, "cc": install.DEFAULT_CC}),
    (["--launcher", "--launcher-path", "/opt/x/runc-launcher", "--cc", "/usr/bin/gcc-12"],
     {"launcher": True, "launcher_path": "/opt/x/runc-launcher", "cc": "/usr/bin/gcc-12"}),
    (["--launcher-path", "/opt/x/l", "--cc", "/usr/local/bin/cc"],
     {"launcher": None, "launcher_path": "/opt/x/l", "cc": "/usr/local/bin/cc"}),
])
def test_cli_launcher_flags_map_onto_options(node: Node, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str], flags: list[str],
                                             expected: dict[str, object]) -> None:
    from snapguard import cli

    seen: list[install.Options] = []

    def plan_install(opts: install.Options) -> install.Plan:
        seen.append(opts)
        return install.Plan("install", state_file=opts.state_file)

    monkeypatch.setattr(install, "plan_install", plan_install)
    monkeypatch.setattr(install, "apply", lambda plan: pytest.fail("--dry-run applied the plan"))
    assert cli.main(["install", "--dry-run", "--json", "--containerd-config", str(node.main), *flags]) == 0
    (opts,) = seen
    assert {k: getattr(opts, k) for k in expected} == expected
    assert json.loads(capsys.readouterr().out)["operation"] == "install"


@pytest.mark.parametrize("flags", [["--launcher", "--no-launcher"], ["--no-launcher", "--launcher"]])
def test_cli_launcher_and_no_launcher_exclude_each_other(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from snapguard import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["install", "--dry-run", *flags])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_cli_launcher_path_with_no_launcher_is_a_usage_error(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    from snapguard import cli

    before = node.snapshot()
    assert cli.main(["install", "--no-launcher", "--launcher-path", str(node.tmp / "l"),
                     "--containerd-config", str(node.main), "--config", str(node.config),
                     "--state-file", str(node.state), "--containerd", str(node.containerd)]) == cli.EXIT_USAGE
    assert "USAGE_ERROR" in capsys.readouterr().err and node.snapshot() == before


def test_cli_help_explains_the_launcher_flags() -> None:
    out = subprocess.run([SNAPGUARD, "install", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for flag in ("--launcher ", "--no-launcher", "--launcher-path PATH", "--cc PATH"):
        assert flag in text, flag
    assert f"default {install.DEFAULT_CC}" in text and install.LAUNCHER_NAME in text


@pytest.mark.parametrize("text", [
    "version = 2\n",
    "# c\nversion = 2\nroot = '/r'\n[grpc]\n  address = 'x'\n",
    "imports = ['/a.toml']\nversion = 2\n",
    "imports = [\n  '/a.toml',  # one\n  '/b/*.toml',\n]\nversion = 2\n[plugins.x]\n  y = [\n[1]]\n",
    "[grpc]\naddress = 'x'\n",
    "version = 2",
])
def test_set_imports_changes_only_that_key(text: str) -> None:
    data = tomllib.loads(text)
    new = install.set_imports(text, [*data.get("imports", []), "/etc/containerd/conf.d/99-snapguard.toml"])
    assert tomllib.loads(new) == {**data, "imports": [*data.get("imports", []), "/etc/containerd/conf.d/99-snapguard.toml"]}
    kept = [line for line in text.splitlines() if not line.startswith(("imports", "  '/", "]"))]
    assert all(line in new.splitlines() for line in kept if line)
    back = install.set_imports(new, data.get("imports"))
    assert tomllib.loads(back) == data


def test_dump_toml_reads_back() -> None:
    data = {"version": 2, "a": {"b c": {"d.e": "q\"\\\n\t\x01", "n": 1.5, "l": [1, "x", {"k": True}], "z": {}},
                                  "f": False}}
    assert tomllib.loads(install.dump_toml(data)) == data


def test_the_kubernetes_example_matches_the_dropin() -> None:
    """packaging/kubernetes/: the RuntimeClass's handler is the runtime the drop-in adds, the
    manifest `snapguard install` prints is the file's, and the DaemonSet writes metrics where the
    systemd unit does."""
    rc = (REPO / "packaging" / "kubernetes" / "runtimeclass.yaml").read_text()
    assert re.search(r"^handler: (\S+)", rc, re.M).group(1) == install.DEFAULT_RUNTIME_NAME
    assert re.search(r"^  name: (\S+)", rc, re.M).group(1) == install.DEFAULT_RUNTIME_NAME
    printed = install.runtimeclass_manifest()
    body = [line for line in rc.splitlines() if line and not line.startswith("#")]
    assert [line.split("#")[0].rstrip() for line in body] == \
        [line.split("#")[0].rstrip() for line in printed.splitlines()]
    ds = (REPO / "packaging" / "kubernetes" / "daemonset.yaml").read_text()
    assert "kind: DaemonSet" in ds and re.search(r"- (/usr/bin/snapguard)\s+- metrics\s", ds)
    links = (REPO / "packaging" / "debian" / "snapguard.links").read_text()
    assert "opt/snapguard/venv/bin/snapguard usr/bin/snapguard\n" in links  # what the DaemonSet runs
    unit = (REPO / "packaging" / "debian" / "snapguard.snapguard-preflight.service").read_text()
    textfile = re.search(r"--textfile[= ](\S+)", unit).group(1)
    assert f"--textfile={textfile}" in ds
    from snapguard.metrics import DEFAULT_TEXTFILE_DIR
    assert textfile == DEFAULT_TEXTFILE_DIR


def test_metrics_textfile(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    from snapguard import metrics
    from snapguard.preflight import CheckResult, Report
    from snapguard.reasons import Finding

    report = Report("--node", required=("host-netns-containers",))
    report.checks += [CheckResult("privileges"), CheckResult("criu", [Finding(Reason.CRIU_MISSING, "no criu")]),
                      CheckResult("runc", error="boom")]
    path = metrics.write_textfile(report, str(tmp_path), 1.25)
    text = Path(path).read_text()
    assert 'snapguard_node_ready 0.0' in text and "snapguard_preflight_exit_code 1.0" in text
    assert 'snapguard_capability_ready{capability="host-netns-containers",required="true"} 0.0' in text
    assert 'snapguard_capability_blocked{capability="host-netns-containers",reason="CRIU_MISSING"} 1.0' in text
    assert 'snapguard_check_ok{check="privileges"} 1.0' in text and 'snapguard_check_ok{check="runc"} 0.0' in text
    assert 'snapguard_check_finding{check="runc",reason="PREFLIGHT_FAILED",severity="error"} 1.0' in text
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert sorted(os.listdir(tmp_path)) == ["snapguard.prom"]


def test_the_config_install_writes_carries_the_key_tables_comments() -> None:
    from snapguard.config import DEFAULTS, keys
    from snapguard.install.config_file import render_config

    text = render_config(dict(DEFAULTS)).decode()
    assert tomllib.loads(text) == DEFAULTS
    for key in keys.KEYS:
        line = next(line for line in text.splitlines() if line.startswith(f"{key.name} = "))
        assert line.endswith(f"  # {key.comment}")
