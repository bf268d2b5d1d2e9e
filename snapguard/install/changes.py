"""The plan `snapguard install` makes: each file's change, its diff and summary, and applying it.

A plan is computed whole before anything is written (`--dry-run` prints it as a diff); apply()
writes each change whole (a temporary file renamed over it), root's, then the state file.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..reasons import Reason
from ..trust import UntrustedPathError, make_private_dir, resolve_trusted
from .base import DEFAULT_RUNTIME_NAME, DEFAULT_STATE_FILE, fail, read_trusted, write_root_file

__all__ = ["Change", "Plan", "apply", "runtimeclass_manifest"]


@dataclass
class Change:
    """One file's change: its bytes before and after, and what the plan says of it."""

    path: str
    action: str  # create, replace, edit, remove, restore, unchanged, keep
    before: bytes | None
    after: bytes | None
    mode: int = 0o644
    summary: str = ""
    binary: bool = False
    render: Callable[[], bytes] | None = None  # the bytes, computed when applied (after the changes before it)

    @property
    def changes(self) -> bool:
        return self.action not in ("unchanged", "keep")

    def diff(self) -> str:
        if self.binary:
            size = "removed" if self.after is None else f"{len(self.after)} bytes"
            return f"binary {self.path}: {size}\n"
        a = (self.before or b"").decode("utf-8", "replace").splitlines(keepends=True)
        b = (self.after or b"").decode("utf-8", "replace").splitlines(keepends=True)
        text = "".join(difflib.unified_diff(a, b, self.path if self.before is not None else "/dev/null",
                                            self.path if self.after is not None else "/dev/null"))
        return text if text.endswith("\n") or not text else text + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "action": self.action, "summary": self.summary,
                "diff": self.diff() if self.changes else ""}


@dataclass
class Plan:
    """Every change install (or --uninstall) makes, what it found, and the state it records."""

    operation: str  # install, uninstall
    changes: list[Change] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    state: dict[str, Any] | None = None  # what the state file holds after apply (None: remove it)
    state_file: str = DEFAULT_STATE_FILE
    dirs: list[str] = field(default_factory=list)  # directories apply creates (install)
    remove_dirs: list[str] = field(default_factory=list)  # directories uninstall removes when empty
    runtime_name: str = DEFAULT_RUNTIME_NAME
    next: list[str] = field(default_factory=list)  # what the operator must still do, beyond the restart

    @property
    def changed(self) -> bool:
        return any(c.changes for c in self.changes)

    def to_dict(self) -> dict[str, Any]:
        out = {"operation": self.operation, "changed": self.changed, "facts": self.facts, "notes": self.notes,
               "changes": [c.to_dict() for c in self.changes]}
        if self.operation == "install":
            out["runtimeclass"] = runtimeclass_manifest(self.runtime_name)
        out["next"] = self.next_steps()
        return out

    def next_steps(self) -> list[str]:
        """What the operator must still do, in order: the plan's own steps (a daemon-reload first),
        containerd's restart where a file changed, then the RuntimeClass."""
        steps = list(self.next)
        if self.changed:
            reload = [s for s in steps if s.startswith("systemctl daemon-reload")]
            steps = reload + ["systemctl restart containerd  (containerd loads its new config)"] + \
                [s for s in steps if s not in reload]
        if self.operation == "install":
            steps.append("kubectl apply -f -  (the RuntimeClass below)")
        return steps

    def to_text(self, dry_run: bool) -> str:
        out = []
        f = self.facts
        if self.operation == "install":
            where = f" ({f['containerd']})" if f.get("containerd") else ""
            out.append(f"snapguard install: containerd {f.get('containerd_version') or '(binary not found)'}{where}, "
                       f"config version {f['config_version']} (from {f['config_version_from']})")
            rt = f["default_runtime"]
            out.append(f"  default runtime `{rt['name']}`: BinaryName {rt['binary'] or '(runc from PATH)'}"
                       f"{' (NVIDIA)' if rt['nvidia'] else ''}, SystemdCgroup "
                       f"{'not set' if rt['systemd_cgroup'] is None else str(rt['systemd_cgroup']).lower()}")
        else:
            out.append("snapguard install --uninstall:")
        for c in self.changes:
            verb = f"would {c.action}" if dry_run and c.changes else c.action
            out.append(f"  {verb:<14} {c.path}{'  (' + c.summary + ')' if c.summary else ''}")
        out += [f"  note: {n}" for n in self.notes]
        if dry_run:
            out += [c.diff().rstrip("\n") for c in self.changes if c.changes]
        if not self.changed:
            out.append("nothing to change")
        elif dry_run:
            out.append("nothing written (--dry-run)")
        steps = self.next_steps()
        if steps and not dry_run:
            out.append("next:")
            out += [f"  {i}. {s}" for i, s in enumerate(steps, 1)]
        if self.operation == "install":
            out.append("RuntimeClass (kubectl apply -f -):")
            out.append(runtimeclass_manifest(self.runtime_name).rstrip("\n"))
        return "\n".join(out) + "\n"


def runtimeclass_manifest(name: str = DEFAULT_RUNTIME_NAME) -> str:
    """The Kubernetes RuntimeClass that selects the drop-in's runtime: its handler is the name."""
    return ("apiVersion: node.k8s.io/v1\n"
            "kind: RuntimeClass\n"
            "metadata:\n"
            f"  name: {name}\n"
            f"handler: {name}  # the containerd runtime `snapguard install` adds\n")


def _check_dir(path: str) -> None:
    """A directory snapguard writes a root-only decision into must itself be root's alone."""
    try:
        resolve_trusted(path, "dir")
    except UntrustedPathError as e:
        raise fail(f"{e}", Reason.UNTRUSTED_PATH if not e.unusable else Reason.USAGE_ERROR) from None


def apply(plan: Plan) -> None:
    """Write the plan (as root): its directories, each change whole, then the state file."""
    if os.geteuid() != 0:
        raise fail("snapguard install writes root's files: run it as root (or with --dry-run)",
                    Reason.INSUFFICIENT_PRIVILEGE)
    for d in plan.dirs:
        os.makedirs(d, mode=0o755, exist_ok=True)
        os.chmod(d, 0o755)
    for c in plan.changes:
        if not c.changes:
            continue
        _check_dir(os.path.dirname(c.path))
        if c.render is not None:
            c.after = c.render()
        if c.after is None:
            os.unlink(c.path)
        else:
            write_root_file(c.path, c.after, c.mode)
    for d in plan.remove_dirs:
        try:
            os.rmdir(d)
        except OSError:
            pass  # not empty: someone else's files are there
    if plan.state is not None:
        directory = make_private_dir(os.path.dirname(plan.state_file))
        data = (json.dumps(plan.state, indent=2, sort_keys=True) + "\n").encode()
        if read_trusted(plan.state_file, "install state") != data:
            write_root_file(os.path.join(directory, os.path.basename(plan.state_file)), data, 0o600)
    elif os.path.exists(plan.state_file):
        os.unlink(plan.state_file)
        try:
            os.rmdir(os.path.dirname(plan.state_file))
        except OSError:
            pass
