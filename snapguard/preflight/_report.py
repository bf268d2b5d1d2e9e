"""A preflight report: which checks ran, what they found, and the exit status it implies.

A node report is also read per capability (`CAPABILITIES`): which kinds of snapshot this node can
take, each ready or blocked by the findings of the checks it needs, and its exit status follows
only the capabilities it was asked to require. `to_junit` writes it for CI systems.
"""

from __future__ import annotations

import json
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..image import Inspected, Manifest
from ..reasons import Finding, Reason, Severity, SnapguardError
from .facts import HostFacts

__all__ = ["CAPABILITIES", "CAPABILITY_NAMES", "Capability", "CapabilityResult", "CheckResult", "Report",
           "EXIT_READY", "EXIT_BLOCKED", "EXIT_UNCHECKED", "check_error_message"]

EXIT_READY, EXIT_BLOCKED, EXIT_UNCHECKED = 0, 1, 2
_VERDICTS = {EXIT_READY: "ready", EXIT_BLOCKED: "blocked", EXIT_UNCHECKED: "unchecked"}


@dataclass(frozen=True)
class Capability:
    """A kind of snapshot a node can take, and the node checks it needs to pass."""

    name: str
    needs: tuple[str, ...]
    summary: str


CAPABILITIES = (
    Capability("host-netns-containers", ("privileges", "criu", "runc"),
               "runc containers in the host's network namespace, no TCP connections carried "
               "(no network lock: iptables not needed)"),
    Capability("own-netns-containers", ("privileges", "criu", "runc", "network-lock"),
               "runc containers with a network namespace of their own (CRIU locks it with iptables-restore)"),
    Capability("bare-processes", ("privileges", "criu"),
               "process trees outside containers (`snapguard checkpoint --pid`) in the host's network namespace"),
    Capability("gpu", ("privileges", "criu", "cuda-plugin", "nvidia-driver"),
               "CUDA state: an NVIDIA driver with the checkpoint API, no MIG, CRIU's CUDA plugin and cuda-checkpoint"),
    Capability("tcp-carry", ("privileges", "criu", "network-lock"),
               "established TCP connections carried in the image (--tcp-established; CRIU locks them with iptables)"),
)
CAPABILITY_NAMES = tuple(c.name for c in CAPABILITIES)


def check_error_message(e: BaseException) -> str:
    """What went wrong in a check that could not run, in the error's own words: one line, never
    the exception's type name (a gate's reader needs the cause, not Python's class)."""
    if isinstance(e, OSError):
        where = f" ({e.filename})" if e.filename else ""
        text = f"{e.strerror or e}{where}"
    else:
        text = str(e).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0][:500] if lines else "the check failed without saying why"


@dataclass
class CheckResult:
    name: str
    findings: list[Finding] = field(default_factory=list)
    error: str | None = None  # the check itself could not run
    error_reason: Reason | None = None  # why it could not run, where more specific than PREFLIGHT_FAILED
    duration_s: float = 0.0

    @property
    def status(self) -> str:
        if self.error:
            return "error"
        if any(f.severity is Severity.BLOCKER for f in self.findings):
            return "blocked"
        return "warning" if self.findings else "ok"

    @property
    def reason(self) -> Reason | None:
        """The typed reason of a check that could not run (None when it ran)."""
        if not self.error:
            return None
        return self.error_reason or Reason.PREFLIGHT_FAILED

    @property
    def blockers(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.BLOCKER]

    def to_dict(self) -> dict[str, Any]:
        reason = self.reason
        return {"name": self.name, "status": self.status, "error": self.error,
                "reason": reason.name if reason else None, "remedy": reason.remedy if reason else None,
                "duration_s": round(self.duration_s, 4), "findings": [f.to_dict() for f in self.findings]}


@dataclass
class CapabilityResult:
    capability: Capability
    required: bool
    blockers: list[Finding]
    unchecked: list[CheckResult]  # needed checks that could not run
    missing: list[str]  # needed checks that did not run at all

    @property
    def name(self) -> str:
        return self.capability.name

    @property
    def status(self) -> str:
        if self.blockers:
            return "blocked"
        return "unchecked" if self.unchecked or self.missing else "ready"

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "required": self.required,
            "summary": self.capability.summary,
            "needs": list(self.capability.needs),
            "blockers": [f.to_dict() for f in self.blockers],
            "unchecked": [{"check": c.name, "reason": c.reason.name if c.reason else None, "detail": c.error}
                          for c in self.unchecked] + [{"check": m, "reason": Reason.PREFLIGHT_FAILED.name,
                                                       "detail": f"check {m} did not run"} for m in self.missing],
        }


@dataclass
class Report:
    target: str
    checks: list[CheckResult] = field(default_factory=list)
    host: HostFacts = field(default_factory=HostFacts)  # what the host checks found out
    image: Inspected | None = None  # a manifest report's image, its digests checked or left to the caller
    processes: list[dict[str, Any]] | None = None  # the workload checks' process summary
    # A node report: the capabilities whose readiness decides the exit status (None: every check does).
    required: tuple[str, ...] | None = None
    # Blockers of a capability that no check carries (a node without the NVIDIA driver has no gpu).
    capability_blockers: dict[str, list[Finding]] = field(default_factory=dict)

    def run(self, name: str, check: Callable[[], list[Finding]]) -> list[Finding]:
        """Run one check. A typed error is its finding; any other error inside it means 'could not
        check' (PREFLIGHT_FAILED with the error's own message), never a crash or a class name."""
        start = time.monotonic()
        try:
            findings = check()
            result = CheckResult(name, findings)
        except SnapguardError as e:
            findings = [Finding(e.reason, e.failure.detail, evidence=e.failure.evidence)]
            result = CheckResult(name, findings)
        except Exception as e:  # noqa: BLE001 - a check that cannot run is a result, not a crash
            findings = []
            result = CheckResult(name, error=check_error_message(e))
        result.duration_s = time.monotonic() - start
        self.checks.append(result)
        return findings

    # --- capabilities (node reports) ------------------------------------------------------------

    @property
    def capabilities(self) -> list[CapabilityResult]:
        if self.required is None:
            return []
        by_name = {c.name: c for c in self.checks}
        out = []
        for cap in CAPABILITIES:
            ran = [by_name[n] for n in cap.needs if n in by_name]
            out.append(CapabilityResult(
                cap, cap.name in self.required,
                blockers=[f for c in ran for f in c.blockers] + list(self.capability_blockers.get(cap.name, [])),
                unchecked=[c for c in ran if c.error],
                missing=[n for n in cap.needs if n not in by_name]))
        return out

    def needed_by(self, check: str) -> list[str]:
        """The capabilities that need `check` (node reports)."""
        return [c.name for c in CAPABILITIES if check in c.needs]

    def gates(self, check: CheckResult) -> bool:
        """Whether this check's outcome decides the exit status: always, except in a node report,
        where only checks that a required capability needs do."""
        return self.required is None or any(n in self.required for n in self.needed_by(check.name))

    # --- verdict ---------------------------------------------------------------------------------

    @property
    def findings(self) -> list[Finding]:
        return [f for c in self.checks for f in c.findings]

    @property
    def blockers(self) -> list[Finding]:
        """What blocks the verdict: every blocker, or in a node report those of the required
        capabilities (each once)."""
        if self.required is None:
            return [f for f in self.findings if f.severity is Severity.BLOCKER]
        seen: list[Finding] = []
        for cap in self.capabilities:
            if cap.required:
                seen += [f for f in cap.blockers if not any(f is s for s in seen)]
        return seen

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.WARNING]

    @property
    def exit_code(self) -> int:
        if self.required is not None:
            caps = [c for c in self.capabilities if c.required]
            if any(c.status == "blocked" for c in caps):
                return EXIT_BLOCKED
            return EXIT_UNCHECKED if any(c.status == "unchecked" for c in caps) else EXIT_READY
        if self.blockers:
            return EXIT_BLOCKED
        if any(c.error for c in self.checks):
            return EXIT_UNCHECKED
        return EXIT_READY

    @property
    def verdict(self) -> str:
        return _VERDICTS[self.exit_code]

    def _driver_absent(self, c: CheckResult) -> bool:
        """The driver check found no driver, so checked nothing: not "ok" beside the gpu blocker."""
        return c.name == "nvidia-driver" and c.status == "ok" and self.host.knows("gpu") and self.host.gpu is None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "target": self.target,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "checks": [{**c.to_dict(), "status": "absent"} if self._driver_absent(c) else c.to_dict()
                       for c in self.checks],
            "blockers": [f.to_dict() for f in self.blockers],
            "warnings": [f.to_dict() for f in self.warnings],
            "facts": self.facts_json(),
        }
        if self.required is not None:
            out["required"] = list(self.required)
            out["capabilities"] = {c.name: c.to_dict() for c in self.capabilities}
        return out

    @property
    def manifest(self) -> Manifest | None:
        return self.image.manifest if self.image is not None else None

    def facts_json(self) -> dict[str, Any]:
        """The report's facts as its JSON carries them: the image's manifest, the host's, the processes'."""
        return {**({"manifest": self.image.manifest.to_json()} if self.image is not None else {}),
                **self.host.to_dict(), **({"processes": self.processes} if self.processes is not None else {})}

    def check_seconds(self, reused: tuple[CheckResult, ...] = ()) -> dict[str, float]:
        """Each check's seconds, by name: where a preflight's time went. `reused`: results taken
        from host checks run ahead (`HostChecks.check_results`), left out: they took no time here."""
        ahead = {id(c) for c in reused}
        return {c.name: round(c.duration_s, 6) for c in self.checks if id(c) not in ahead}

    def raise_blockers(self) -> None:
        """Refuse with the first blocker (the others travel as evidence), or when a check could
        not run: an unknown is not a go."""
        blockers = self.blockers
        if blockers:
            first = blockers[0]
            evidence = dict(first.evidence)
            if len(blockers) > 1:
                evidence["other_blockers"] = [b.to_dict() for b in blockers[1:]]
            raise SnapguardError(first.reason, first.detail, evidence=evidence, warnings=self.warnings)
        for check in self.checks:
            if check.error:
                raise SnapguardError(check.reason or Reason.PREFLIGHT_FAILED,
                                     f"check {check.name} could not run: {check.error}",
                                     evidence={"check": check.name})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def to_text(self) -> str:
        lines = [f"snapguard preflight {self.target}: {self.verdict.upper()}"]
        versions = [f"{name} {getattr(self.host, key)}" for name, key in
                    (("runc", "runc_version"), ("containerd", "containerd_version"), ("CRIU", "criu_version"))
                    if getattr(self.host, key)]
        if versions:
            lines.append(f"runtime: {', '.join(versions)}")
        spill = self.host.spill
        if isinstance(spill, dict):
            lines.append(f"take point spills: {spill.get('dir')} ("
                         f"{'huge pages' if spill.get('huge_pages') else spill.get('hint', '4 KiB pages')})")
        caps = self.capabilities
        if caps:
            lines.append(f"required: {', '.join(self.required or ()) or '(nothing)'}")
            cwidth = max(len(cap.name) for cap in caps)
            lines += ["", f"{'capability':<{cwidth}}  required  status     why"]
            for cap in caps:
                why = sorted({f.reason.name for f in cap.blockers}) or \
                    [f"{u.reason.name if u.reason else ''} ({u.name})" for u in cap.unchecked] + \
                    [f"{Reason.PREFLIGHT_FAILED.name} ({m} did not run)" for m in cap.missing]
                lines.append(f"{cap.name:<{cwidth}}  {'yes' if cap.required else 'no':<8}  {cap.status:<9}  "
                             f"{', '.join(why)}".rstrip())
        width = max([len(c.name) for c in self.checks] + [5])
        lines += ["", f"{'check':<{width}}  status   detail"]
        for c in self.checks:
            details = [str(f) for f in c.findings] or \
                ([f"{c.reason.name if c.reason else ''}: {c.error}"] if c.error else [""])
            no_driver = self._driver_absent(c)
            if no_driver:
                details = [f"{Reason.GPU_DRIVER_MISSING.name}: no NVIDIA driver on this node, nothing to check"]
            for i, d in enumerate(details):
                name, status = (c.name, "absent" if no_driver else c.status) if i == 0 else ("", "")
                lines.append(f"{name:<{width}}  {status:<7}  {d}".rstrip())
        errors = [c for c in self.checks if c.error and self.gates(c)]
        remedies = _remedies(self.blockers, errors)
        if remedies:
            lines += ["", "remedies:"] + [f"  {r}" for r in remedies]
        if caps:
            others = [r for r in _remedies([f for c in caps if not c.required for f in c.blockers],
                                           [c for c in self.checks if c.error and not self.gates(c)])
                      if r not in remedies]
            if others:
                lines += ["", "to make the capabilities not required ready:"] + [f"  {r}" for r in others]
        return "\n".join(lines)

    # --- JUnit XML ---------------------------------------------------------------------------------

    def to_junit(self, version: str = "") -> bytes:
        """JUnit XML for CI systems: one testcase per check (a blocker is a <failure> whose type is
        the reason, a check that could not run an <error>, warnings in <system-out>), and in a node
        report one per capability. What blocks only capabilities that are not required is
        <skipped> with the reason in its message, so the published report agrees with the exit
        status."""
        import xml.etree.ElementTree as ET

        kind = self.target.split()[0].lstrip("-") or "target"
        root = ET.Element("testsuites", name="snapguard preflight")
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        host = socket.gethostname()
        props = {"target": self.target, "verdict": self.verdict, "exit_code": str(self.exit_code),
                 "snapguard_version": version, "criu_version": str(self.host.criu_version if self.host.knows("criu_version") else "")}
        if self.required is not None:
            props["required"] = ",".join(self.required)

        checks = ET.SubElement(root, "testsuite", name=f"snapguard preflight {self.target}", timestamp=stamp,
                               hostname=host)
        properties = ET.SubElement(checks, "properties")
        for k, v in props.items():
            ET.SubElement(properties, "property", name=k, value=_xml_text(v))
        for c in self.checks:
            case = ET.SubElement(checks, "testcase", name=c.name, classname=f"snapguard.preflight.{kind}",
                                 time=f"{c.duration_s:.3f}")
            self._junit_check(case, c)
        _count(checks)
        suites = [checks]
        caps = self.capabilities
        if caps:
            capsuite = ET.SubElement(root, "testsuite", name=f"snapguard preflight {self.target} capabilities",
                                     timestamp=stamp, hostname=host)
            for cap in caps:
                case = ET.SubElement(capsuite, "testcase", name=cap.name,
                                     classname=f"snapguard.preflight.{kind}.capability", time="0.000")
                _junit_capability(case, cap)
            _count(capsuite)
            suites.append(capsuite)
        for attr in ("tests", "failures", "errors", "skipped"):
            root.set(attr, str(sum(int(s.get(attr, "0")) for s in suites)))
        root.set("time", f"{sum(float(s.get('time', '0')) for s in suites):.3f}")
        return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"

    def _junit_check(self, case: Any, c: CheckResult) -> None:
        import xml.etree.ElementTree as ET

        gates = self.gates(c)
        unrequired = "needed only by capabilities not required here" if self.required is not None and \
            self.needed_by(c.name) else "needed by no capability"
        if c.error:
            reason = c.reason or Reason.PREFLIGHT_FAILED
            message = f"{reason.name}: {c.error}"
            if gates:
                el = ET.SubElement(case, "error", type=reason.name, message=_xml_text(message))
                el.text = _xml_text(f"{message}\nremedy: {reason.remedy}")
            else:
                ET.SubElement(case, "skipped", message=_xml_text(f"{unrequired}; could not run: {message}"))
        elif c.blockers:
            first = c.blockers[0]
            if gates:
                el = ET.SubElement(case, "failure", type=first.reason.name,
                                   message=_xml_text("; ".join(str(f) for f in c.blockers)))
                el.text = _xml_text("\n\n".join(_finding_text(f) for f in c.blockers))
            else:
                ET.SubElement(case, "skipped", message=_xml_text(
                    f"{unrequired} ({', '.join(self.needed_by(c.name))}); blocked: "
                    + "; ".join(str(f) for f in c.blockers)))
        warnings = [f for f in c.findings if f.severity is Severity.WARNING]
        if warnings:
            out = ET.SubElement(case, "system-out")
            out.text = _xml_text("\n\n".join(f"WARNING {_finding_text(f)}" for f in warnings))


def _junit_capability(case: Any, cap: CapabilityResult) -> None:
    import xml.etree.ElementTree as ET

    if cap.status == "ready":
        return
    if cap.status == "blocked":
        message = "; ".join(str(f) for f in cap.blockers)
        if cap.required:
            el = ET.SubElement(case, "failure", type=cap.blockers[0].reason.name, message=_xml_text(message))
            el.text = _xml_text("\n\n".join(_finding_text(f) for f in cap.blockers))
        else:
            ET.SubElement(case, "skipped", message=_xml_text(f"not required (--require); blocked: {message}"))
        return
    parts = [f"{u.reason.name if u.reason else ''}: check {u.name} could not run: {u.error}" for u in cap.unchecked]
    parts += [f"{Reason.PREFLIGHT_FAILED.name}: check {m} did not run" for m in cap.missing]
    if cap.required:
        el = ET.SubElement(case, "error", type=(cap.unchecked[0].reason or Reason.PREFLIGHT_FAILED).name
                           if cap.unchecked else Reason.PREFLIGHT_FAILED.name, message=_xml_text("; ".join(parts)))
        el.text = _xml_text("\n".join(parts) + f"\nremedy: {Reason.PREFLIGHT_FAILED.remedy}")
    else:
        ET.SubElement(case, "skipped", message=_xml_text(f"not required (--require); unchecked: {'; '.join(parts)}"))


def _count(suite: Any) -> None:
    cases = suite.findall("testcase")
    suite.set("tests", str(len(cases)))
    for attr, tag in (("failures", "failure"), ("errors", "error"), ("skipped", "skipped")):
        suite.set(attr, str(sum(1 for c in cases if c.find(tag) is not None)))
    suite.set("time", f"{sum(float(c.get('time', '0')) for c in cases):.3f}")


def _finding_text(f: Finding) -> str:
    text = f"{f.reason.name}: {f.detail}\nmeaning: {f.reason.meaning}\nremedy: {f.reason.remedy}"
    if f.evidence:
        text += f"\nevidence: {json.dumps(f.evidence, sort_keys=True, default=str)[:4000]}"
    return text


_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_text(text: str) -> str:
    """XML 1.0 cannot carry most control characters (CRIU's output may hold some): replaced."""
    return _NOT_XML.sub("\ufffd", text)


def _remedies(blockers: list[Finding], errors: list[CheckResult]) -> list[str]:
    out: list[str] = []
    for reason in [f.reason for f in blockers] + [c.reason for c in errors if c.reason]:
        line = f"{reason.name}: {reason.remedy}"
        if line not in out:
            out.append(line)
    return out
