"""A preflight report: which checks ran, what they found, and the exit status it implies."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from ..reasons import Finding, Reason, Severity, SnapguardError

__all__ = ["CheckResult", "Report", "EXIT_READY", "EXIT_BLOCKED", "EXIT_UNCHECKED"]

EXIT_READY, EXIT_BLOCKED, EXIT_UNCHECKED = 0, 1, 2


@dataclass
class CheckResult:
    name: str
    findings: list[Finding] = field(default_factory=list)
    error: str | None = None  # the check itself could not run

    @property
    def status(self) -> str:
        if self.error:
            return "error"
        if any(f.severity is Severity.BLOCKER for f in self.findings):
            return "blocked"
        return "warning" if self.findings else "ok"


@dataclass
class Report:
    target: str
    checks: list[CheckResult] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def run(self, name: str, check: Callable[[], list[Finding]]) -> list[Finding]:
        """Run one check; an OSError or ValueError inside it means 'could not check', not a crash."""
        try:
            findings = check()
            self.checks.append(CheckResult(name, findings))
        except SnapguardError as e:
            findings = [Finding(e.reason, e.failure.detail, evidence=e.failure.evidence)]
            self.checks.append(CheckResult(name, findings))
        except OSError as e:
            findings = []
            where = f" ({e.filename})" if e.filename else ""
            self.checks.append(CheckResult(name, error=f"{e.strerror or e}{where}"))
        except ValueError as e:
            findings = []
            self.checks.append(CheckResult(name, error=str(e)))
        return findings

    @property
    def findings(self) -> list[Finding]:
        return [f for c in self.checks for f in c.findings]

    @property
    def blockers(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.BLOCKER]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.WARNING]

    @property
    def exit_code(self) -> int:
        if self.blockers:
            return EXIT_BLOCKED
        if any(c.error for c in self.checks):
            return EXIT_UNCHECKED
        return EXIT_READY

    @property
    def verdict(self) -> str:
        return {EXIT_READY: "ready", EXIT_BLOCKED: "blocked", EXIT_UNCHECKED: "unchecked"}[self.exit_code]

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "checks": [{"name": c.name, "status": c.status, "error": c.error,
                        "findings": [f.to_dict() for f in c.findings]} for c in self.checks],
            "blockers": [f.to_dict() for f in self.blockers],
            "warnings": [f.to_dict() for f in self.warnings],
            "facts": self.facts,
        }

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
                raise SnapguardError(Reason.PREFLIGHT_FAILED, f"check {check.name} could not run: {check.error}",
                                     evidence={"check": check.name})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def to_text(self) -> str:
        width = max([len(c.name) for c in self.checks] + [5])
        lines = [f"snapguard preflight {self.target}: {self.verdict.upper()}", ""]
        lines.append(f"{'check':<{width}}  status   detail")
        for c in self.checks:
            details = [str(f) for f in c.findings] or ([c.error] if c.error else [""])
            for i, d in enumerate(details):
                name, status = (c.name, c.status) if i == 0 else ("", "")
                lines.append(f"{name:<{width}}  {status:<7}  {d}".rstrip())
        if self.blockers:
            lines += ["", "remedies:"]
            lines += [f"  {f.reason.name}: {f.reason.remedy}" for f in self.blockers]
        return "\n".join(lines)
