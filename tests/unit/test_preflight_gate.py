"""`snapguard preflight` as a CI gate: node verdicts per capability, `--require`, typed reasons for
checks that cannot run, and the JUnit report read back by a real JUnit consumer (junitparser).

The in-process tests need nothing; the real node checks, which run CRIU as root, are in
tests/system/test_root_preflight_gate.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from junitparser import Error, Failure, JUnitXml, Skipped

from snapguard import preflight
from snapguard.config import load
from snapguard.preflight import CAPABILITIES, CAPABILITY_NAMES, CheckResult, Report
from snapguard.reasons import Finding, Reason, Severity

EXCEPTION_NAMES = re.compile(r"\b\w*(Error|Exception|Broken)\w*|Traceback")
def _no_exception_names(text: str) -> None:
    """No Python exception class name anywhere (typed reasons such as RUNC_UNUSABLE are upper case)."""
    hits = [m.group(0) for m in EXCEPTION_NAMES.finditer(text) if not m.group(0).isupper()]
    assert not hits, f"exception names in the output: {hits}"


def _node(blocked: dict[str, Finding] | None = None, errors: dict[str, str] | None = None,
          require: tuple[str, ...] = ("host-netns-containers",)) -> Report:
    """A node report of fabricated check results: every node check ok unless named."""
    blocked, errors = blocked or {}, errors or {}
    report = Report("--node", required=require)
    for name in ("privileges", "criu", "network-lock", "cuda-plugin", "nvidia-driver", "runc", "gpu-handles"):
        report.checks.append(CheckResult(name, [blocked[name]] if name in blocked else [], error=errors.get(name)))
    return report


NO_IPTABLES = Finding(Reason.NETWORK_LOCK_UNAVAILABLE, "none of /usr/sbin/iptables-restore exists")


def _caps(report: Report) -> dict[str, str]:
    return {c.name: c.status for c in report.capabilities}


# --- capabilities on fabricated check results --------------------------------------------------------


def test_missing_iptables_blocks_only_what_needs_the_network_lock() -> None:
    report = _node({"network-lock": NO_IPTABLES})
    assert _caps(report) == {"host-netns-containers": "ready", "own-netns-containers": "blocked",
                             "bare-processes": "ready", "gpu": "ready", "tcp-carry": "blocked"}
    assert report.exit_code == preflight.EXIT_READY and report.verdict == "ready"
    assert report.blockers == []  # nothing blocks what is required
    text = report.to_text()
    assert text.splitlines()[0] == "snapguard preflight --node: READY"
    assert "NETWORK_LOCK_UNAVAILABLE: install iptables" in text  # what would make the others ready


@pytest.mark.parametrize("require,code", [
    (("host-netns-containers",), preflight.EXIT_READY),
    (("host-netns-containers", "gpu"), preflight.EXIT_READY),
    (("own-netns-containers",), preflight.EXIT_BLOCKED),
    (("bare-processes", "tcp-carry"), preflight.EXIT_BLOCKED),
    (CAPABILITY_NAMES, preflight.EXIT_BLOCKED),
])
def test_exit_code_follows_require(require: tuple[str, ...], code: int) -> None:
    report = _node({"network-lock": NO_IPTABLES}, require=require)
    assert report.exit_code == code
    assert [f.reason for f in report.blockers] == ([Reason.NETWORK_LOCK_UNAVAILABLE] if code else [])
    assert json.loads(report.to_json())["required"] == list(require)


def test_a_broken_criu_blocks_every_capability() -> None:
    report = _node({"criu": Finding(Reason.CRIU_BROKEN, "libnet.so.1: cannot open shared object file")})
    assert set(_caps(report).values()) == {"blocked"}
    assert report.exit_code == preflight.EXIT_BLOCKED


def test_a_check_that_could_not_run_leaves_only_its_capabilities_unchecked() -> None:
    report = _node(errors={"cuda-plugin": "Permission denied (/usr/local/lib/criu)"},
                   require=("host-netns-containers", "gpu"))
    assert _caps(report)["gpu"] == "unchecked" and _caps(report)["host-netns-containers"] == "ready"
    assert report.exit_code == preflight.EXIT_UNCHECKED
    gpu = report.to_dict()["capabilities"]["gpu"]
    assert gpu["unchecked"] == [{"check": "cuda-plugin", "reason": "PREFLIGHT_FAILED",
                                 "detail": "Permission denied (/usr/local/lib/criu)"}]
    # the same failure is no reason to fail a gate that does not require the GPU
    report.required = ("host-netns-containers",)
    assert report.exit_code == preflight.EXIT_READY


def test_a_blocker_beats_an_unknown() -> None:
    report = _node({"runc": Finding(Reason.RUNC_UNUSABLE, "runc is missing")}, errors={"criu": "timed out"})
    assert report.exit_code == preflight.EXIT_BLOCKED


def test_default_requirements_follow_the_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight.gpu, "NVIDIA_DRIVER", str(tmp_path / "absent"))
    assert preflight.default_requirements() == ("host-netns-containers",)
    (tmp_path / "version").write_text("NVRM version: 580.159.04\n")
    monkeypatch.setattr(preflight.gpu, "NVIDIA_DRIVER", str(tmp_path / "version"))
    assert preflight.default_requirements() == ("host-netns-containers", "gpu")


def test_capability_table_names_real_checks() -> None:
    node_checks = {"privileges", "criu", "network-lock", "cuda-plugin", "nvidia-driver", "runc"}
    assert all(set(c.needs) <= node_checks for c in CAPABILITIES)
    assert CAPABILITY_NAMES == ("host-netns-containers", "own-netns-containers", "bare-processes", "gpu",
                                "tcp-carry")


class NVMLError_DriverNotLoaded(Exception):  # noqa: N801 - shaped like pynvml's
    def __str__(self) -> str:
        return "Driver Not Loaded"


@pytest.mark.parametrize("exc,message", [
    (NVMLError_DriverNotLoaded(), "Driver Not Loaded"),
    (ValueError("`criu --version` printed no version (exit 127)"), "`criu --version` printed no version (exit 127)"),
    (PermissionError(13, "Permission denied", "/proc/1/maps"), "Permission denied (/proc/1/maps)"),
    (KeyError(), "the check failed without saying why"),
])
def test_a_check_that_raises_is_a_typed_reason_with_its_message(exc: Exception, message: str) -> None:
    report = Report("--node", required=("gpu",))

    def check() -> list[Finding]:
        raise exc

    assert report.run("nvidia-driver", check) == []
    [result] = report.checks
    assert result.status == "error" and result.reason is Reason.PREFLIGHT_FAILED and result.error == message
    out = report.to_text() + report.to_json() + report.to_junit().decode()
    assert f"PREFLIGHT_FAILED: {message}" in report.to_text()
    _no_exception_names(out)


# --- JUnit, read by junitparser ---------------------------------------------------------------------


def _junit(report: Report, tmp_path: Path) -> JUnitXml:
    path = tmp_path / "preflight.xml"
    path.write_bytes(report.to_junit("9.9.9"))
    return JUnitXml.fromfile(str(path))


def test_junit_one_testcase_per_check_and_capability(tmp_path: Path) -> None:
    report = _node({"network-lock": NO_IPTABLES,
                    "runc": Finding(Reason.RUNC_UNUSABLE, "runc /usr/sbin/runc does not exist", evidence={"path": "x"}),
                    "nvidia-driver": Finding(Reason.PERSISTENCE_MODE_OFF, "GPU 0 has persistence mode off",
                                             Severity.WARNING)},
                   errors={"gpu-handles": "Permission denied (/proc/7/maps)"})
    xml = _junit(report, tmp_path)
    suites = {s.name: s for s in xml}
    checks = suites["snapguard preflight --node"]
    caps = suites["snapguard preflight --node capabilities"]
    cases = {c.name: c for c in checks}
    assert list(cases) == [c.name for c in report.checks]
    assert {c.name for c in caps} == set(CAPABILITY_NAMES)

    # a blocker of a required capability: a failure carrying the reason, its detail and remedy
    [runc] = cases["runc"].result
    assert isinstance(runc, Failure) and runc.type == "RUNC_UNUSABLE"
    assert runc.message == "RUNC_UNUSABLE: runc /usr/sbin/runc does not exist"
    assert f"remedy: {Reason.RUNC_UNUSABLE.remedy}" in runc.text
    # blocking only capabilities that are not required: skipped, the reason still said
    [lock] = cases["network-lock"].result
    assert isinstance(lock, Skipped) and "NETWORK_LOCK_UNAVAILABLE" in lock.message
    assert "own-netns-containers" in lock.message
    # a check needed by no capability that could not run: skipped with its typed reason
    [handles] = cases["gpu-handles"].result
    assert isinstance(handles, Skipped) and "PREFLIGHT_FAILED: Permission denied (/proc/7/maps)" in handles.message
    # a warning: passed, and said in system-out
    assert cases["nvidia-driver"].is_passed and "PERSISTENCE_MODE_OFF" in cases["nvidia-driver"].system_out
    assert cases["privileges"].is_passed

    capcases = {c.name: c for c in caps}
    [host_netns] = capcases["host-netns-containers"].result
    assert isinstance(host_netns, Failure) and host_netns.type == "RUNC_UNUSABLE"
    assert capcases["bare-processes"].is_passed
    [own] = capcases["own-netns-containers"].result
    assert isinstance(own, Skipped) and "not required" in own.message

    # the counts junitparser reads agree with what the file says of itself
    assert (checks.tests, checks.failures, checks.errors, checks.skipped) == (7, 1, 0, 2)
    assert (caps.tests, caps.failures, caps.errors, caps.skipped) == (5, 1, 0, 2)
    props = {p.name: p.value for p in checks.properties()}
    assert props["verdict"] == "blocked" and props["exit_code"] == "1"
    assert props["required"] == "host-netns-containers" and props["snapguard_version"] == "9.9.9"


def test_junit_unchecked_required_check_is_an_error(tmp_path: Path) -> None:
    report = _node(errors={"criu": "`criu check` did not finish in 60 s\x00\x1b[0m"})
    xml = _junit(report, tmp_path)  # control characters from a tool's output stay parseable
    checks = next(iter(xml))
    [err] = next(c for c in checks if c.name == "criu").result
    assert isinstance(err, Error) and err.type == "PREFLIGHT_FAILED"
    assert err.message.startswith("PREFLIGHT_FAILED: `criu check` did not finish in 60 s")
    assert f"remedy: {Reason.PREFLIGHT_FAILED.remedy}" in err.text


def test_junit_of_a_workload_report(tmp_path: Path) -> None:
    """Reports without capabilities (--pid, --container, --manifest): one suite, every blocker fails."""
    report = Report("--pid 42")
    report.checks.append(CheckResult("io-uring", [Finding(Reason.IO_URING_PRESENT, "pid 42 (x) has an io_uring")]))
    report.checks.append(CheckResult("tcp"))
    [suite] = list(_junit(report, tmp_path))
    assert suite.name == "snapguard preflight --pid 42" and (suite.tests, suite.failures) == (2, 1)
    [fail] = next(c for c in suite if c.name == "io-uring").result
    assert fail.type == "IO_URING_PRESENT" and next(c for c in suite if c.name == "tcp").classname == \
        "snapguard.preflight.pid"


# --- the CLI ---------------------------------------------------------------------------------------


def snapguard(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "snapguard")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_cli_unusable_config_still_writes_the_reports(tmp_path: Path) -> None:
    junit = tmp_path / "preflight.xml"
    out = snapguard("preflight", "--node", "--json", "--junit", str(junit),
                    env={"SNAPGUARD_CONFIG": str(tmp_path / "missing.toml")})
    assert out.returncode == 2 and out.stderr.startswith("snapguard CONFIG_INVALID: ")
    assert json.loads(out.stdout)["verdict"] == "unchecked"
    [err] = next(iter(next(iter(JUnitXml.fromfile(str(junit)))))).result
    assert isinstance(err, Error) and err.type == "CONFIG_INVALID" and "missing.toml" in err.message


def test_cli_unforeseen_error_is_preflight_failed_in_its_own_words(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from snapguard import cli

    class NVMLError_LibraryNotFound(Exception):  # noqa: N801 - shaped like pynvml's
        pass

    def node_report(*_: object) -> Report:
        raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    monkeypatch.setattr(preflight, "node_report", node_report)
    monkeypatch.setenv("SNAPGUARD_STATE_DIR", str(tmp_path / "state"))
    junit = tmp_path / "preflight.xml"
    assert cli.main(["preflight", "--node", "--json", "--junit", str(junit)]) == preflight.EXIT_UNCHECKED
    out = capsys.readouterr()
    assert out.err == "snapguard PREFLIGHT_FAILED: NVML Shared Library Not Found\n"
    assert json.loads(out.out)["checks"][0]["reason"] == "PREFLIGHT_FAILED"
    _no_exception_names(out.out + out.err + junit.read_text())
    [err] = next(iter(next(iter(JUnitXml.fromfile(str(junit)))))).result
    assert isinstance(err, Error) and err.message == "PREFLIGHT_FAILED: NVML Shared Library Not Found"


def test_a_pid_that_is_gone_is_unchecked_with_its_reason(tmp_path: Path) -> None:
    report = preflight.pid_report(2**22 + 7, load({"SNAPGUARD_STATE_DIR": str(tmp_path / "state")}))
    [check] = report.checks
    assert report.exit_code == preflight.EXIT_UNCHECKED and check.reason is Reason.PROCESS_NOT_FOUND
    assert report.to_dict()["checks"][0]["reason"] == "PROCESS_NOT_FOUND"


@pytest.mark.parametrize("args,said", [
    (["--node", "--require", "gpu,warp-drive"], "unknown capability warp-drive"),
    (["--node", "--require", ","], "no capability named"),
    (["--pid", "1", "--require", "gpu"], "--require applies to --node only"),
])
def test_cli_require_usage_errors(args: list[str], said: str) -> None:
    out = snapguard("preflight", *args)
    assert out.returncode == 2 and out.stderr.startswith("snapguard USAGE_ERROR: ") and said in out.stderr
    assert out.stderr.count("\n") == 1


def test_help_has_the_exit_codes_capabilities_and_reasons() -> None:
    text = snapguard("preflight", "--help").stdout
    for code, verdict in ((0, "READY"), (1, "BLOCKED"), (2, "UNCHECKED")):
        assert re.search(rf"^  {code}  {verdict}\s", text, re.M), verdict
    for cap in CAPABILITIES:
        assert re.search(rf"^  {cap.name}\s.*\n\s+needs: {', '.join(cap.needs)}$", text, re.M), cap.name
    named = set(re.findall(r"\b[A-Z]+(?:_[A-Z]+)+\b", text))
    assert named <= set(Reason.__members__), named - set(Reason.__members__)
    assert {"CRIU_BROKEN", "NETWORK_LOCK_UNAVAILABLE", "PREFLIGHT_FAILED", "RUNC_UNUSABLE"} <= named
