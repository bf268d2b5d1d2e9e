"""One workload behind either entry point, so that a test of a guarantee runs through both.

A target is a process tree that snapguard can checkpoint and restore, started and snapshotted
through one of snapguard's two entry points:

  bare  the workload is a plain process tree; `snapguard checkpoint --pid P --images DIR` and
        `snapguard restore --images DIR` snapshot it (snapguard runs CRIU itself). The record of a
        run goes into the image directory, and only when that directory exists.
  runc  the workload is a runc container (a bundle of bind mounts of this host's own directories,
        see bundles.host_bundle) driven directly through snapguard-runc as containerd would drive
        it, no containerd needed: `snapguard-runc --root R run -d` (passed through to runc), then
        `snapguard-runc --root R --log L --log-format json checkpoint --image-path I --work-path W`
        and `... restore --image-path I --work-path W --bundle B --detach --pid-file P`. The record
        goes into the work path, always.

Both have one interface: `start()`, `checkpoint(images, work, leave_running, extra_env)` and
`restore(images, work, extra_env)` (each a CompletedProcess: returncode, stdout, stderr), `alive()`,
`advancing()`, `log` (a testbed.CounterLog), `record(images, work)` and `stop()`. The snapguard
configuration is a TOML file the target writes (`configure(**keys)` rewrites it between calls) and
passes through SNAPGUARD_CONFIG, with SNAPGUARD_STATE_DIR beside it.

The default workload is a counter that appends "i hash" lines (the hash chain of testbed) to its
log, opening the log with open(..., "a") at each step, so that no file is held open across a
snapshot. `IDLE_TRAINER` is the same counter in a process that imported torch's optimizers and runs
the take-point hook but never steps: it never reaches a step boundary.

Also here, for fault injection beyond CRIU's own (CRIU_FAULT, which snapguard passes on to runc
and CRIU with the rest of its environment): `criu_wrapper`, root-owned stand-ins for CRIU that
fail, hang, vanish or fill the image's file system in a chosen way, and `failing_tool`, a stand-in
for any tool (cuda-checkpoint) that fails one action; `typed_lines` picks the `snapguard REASON:`
lines out of a run's stderr, `wait_gone` waits for processes to go.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from snapguard.takepoint import site_dir

from .bundles import RUNC, host_bundle, release_mounts
from .testbed import CounterLog, product_root, snapguard_runc_path

__all__ = ["COUNTER", "CRIU", "IDLE_TRAINER", "KINDS", "RESULT_NAME", "BareTarget", "RuncTarget", "Target",
           "criu_wrapper", "failing_tool", "image_files", "make_target", "snapguard_path", "typed_lines", "wait_gone",
           "write_config"]

CRIU = "/usr/local/sbin/criu"
CRIU_LIBDIR = "/usr/local/lib/criu"
# where snapguard writes the record of a run (snapguard.names.RESULT_NAME; the lab uses only the
# product's public modules)
RESULT_NAME = "snapguard-result.json"
KINDS = ("bare", "runc")

COUNTER = """
import sys, time
i = h = 0
while True:
    i += 1
    h = (h * 31 + i) % 1000000007
    with open(sys.argv[1], "a") as f:
        f.write(f"{i} {h}\\n")
    time.sleep(0.01)
"""

# A process the take point sees as a trainer (it imported torch's optimizers, so the hook's step
# hook is registered) that never finishes an optimizer step: a take request waits in vain.
IDLE_TRAINER = """
import torch
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)  # never steps
""" + COUNTER


def snapguard_path() -> str:
    """The installed `snapguard` command, beside this Python."""
    exe = os.path.join(os.path.dirname(sys.executable), "snapguard")
    if not os.path.exists(exe):
        raise RuntimeError(f"snapguard is not installed next to {sys.executable}; run `pip install -e .`")
    return exe


def write_config(path: Path, **keys: Any) -> Path:
    """snapguard's TOML config at `path` (0600), root's: strings quoted, booleans true/false,
    numbers as they are."""
    lines = []
    for key, value in keys.items():
        if value is None:
            continue
        lines.append(f"{key} = {json.dumps(value) if isinstance(value, (str, bool)) else value}")
    path.write_text("".join(f"{line}\n" for line in lines))
    os.chmod(path, 0o600)
    return path


def criu_wrapper(path: Path, behaviour: str, *, real: str = CRIU, fill_dir: str | None = None) -> Path:
    """A root-owned (0700) shell script standing in for CRIU at `path`. `--version` and `check` go
    to the real CRIU, so preflight passes; what it does for a run (`dump`, `restore`, `swrk`):

      fail    exit 1 at once, as a CRIU that dies at its start
      hang    sleep for an hour (its pid is appended to `<path>.pids` first, then the sleep
              replaces the shell: a test can tell whether the process survived a kill)
      fill    run the real CRIU, then, once a dump is in `fill_dir` (inventory.img), fill that
              directory's file system with empty files until one inode is left: the manifest
              fits, the completion marker does not
      vanish  for `check`: run the real one, then make this script non-executable, so that the
              run that follows cannot start it (a CRIU removed between preflight and the dump)
      kill-executor
              run the real CRIU; after a dump that succeeded, SIGKILL the process that started
              it (snapguard's executor: an executor killed between the dump and its cleanup)
    """
    pids = f"{path}.pids"
    run = {
        "fail": 'echo "criu-wrapper: failing at start" >&2; exit 1',
        "hang": f'echo $$ >> "{pids}"; exec /bin/sleep 3600',
        "fill": f'"{real}" "$@"; rc=$?\n'
                f'if [ -e "{fill_dir}/inventory.img" ]; then\n'
                f'  n=0\n'
                f'  while [ "$(stat -f -c %d "{fill_dir}")" -gt 1 ]; do n=$((n+1)); : > "{fill_dir}/fill-$n"; done\n'
                f'fi\n'
                f'exit $rc',
        "vanish": f'exec "{real}" "$@"',
        "kill-executor": f'"{real}" "$@"; rc=$?\n'
                         'if [ "$1" = dump ] && [ "$rc" -eq 0 ]; then kill -KILL "$PPID"; fi\n'
                         'exit $rc',
    }[behaviour]
    check = f'"{real}" check; rc=$?; chmod 0600 "$0"; exit $rc' if behaviour == "vanish" else f'exec "{real}" "$@"'
    path.write_text("#!/bin/sh\n"
                    "case \"$1\" in\n"
                    f'  --version|-V) exec "{real}" "$@" ;;\n'
                    f"  check) {check} ;;\n"
                    "esac\n"
                    f"{run}\n")
    os.chmod(path, 0o700)
    return path


def failing_tool(path: Path, real: str, words: str) -> Path:
    """A root-owned (0700) stand-in for the tool `real` that exits 1 when its arguments contain
    `words` (e.g. "--action restore") and runs the real tool otherwise."""
    path.write_text("#!/bin/sh\n"
                    f'case " $* " in *" {words} "*) echo "failing-tool: {words}" >&2; exit 1 ;; esac\n'
                    f'exec "{real}" "$@"\n')
    os.chmod(path, 0o700)
    return path


TYPED = re.compile(r"^snapguard ([A-Z][A-Z0-9_]+): ")


def typed_lines(stderr: str) -> list[str]:
    """The lines of a run's stderr that carry a typed reason (`snapguard REASON: ...`)."""
    return [line for line in stderr.splitlines() if TYPED.match(line)]


def _alive(pid: int | None) -> bool:
    """pid runs (not gone, not a zombie)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class Target:
    """A workload under one entry point; see the module's docstring. `workdir` holds everything
    of it (config, state dir, log, bundle); `script` is the workload's Python code, run with its
    log's path as argv[1]; `hook` starts it with snapguard's take-point hook."""

    kind = ""

    def __init__(self, workdir: Path, *, script: str = COUNTER, hook: bool = False, timeout: float = 120,
                 devices: list[str] | None = None) -> None:
        self.workdir = workdir
        self.devices = devices or []  # host character devices the workload needs (a container binds them)
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o700)
        self.script = script
        self.hook = hook
        self.timeout = timeout
        self.out = workdir / "out"
        self.out.mkdir(exist_ok=True)
        self.log = CounterLog(self.out / "counter.log")
        self.state_dir = workdir / "state"
        self.config = workdir / "config.toml"
        self.config_keys: dict[str, Any] = {}
        self.configure()
        self._calls = 0

    # -- configuration -------------------------------------------------------------------------

    def configure(self, **keys: Any) -> Path:
        """Rewrite the config file with these keys (None removes one) over the defaults here:
        the real runc and CRIU, CRIU's libdir, this target's state dir."""
        self.config_keys.update(keys)
        base = {"runc": RUNC, "criu": CRIU, "criu_libdir": CRIU_LIBDIR, "state_dir": str(self.state_dir)}
        return write_config(self.config, **{**base, **self.config_keys})

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, "SNAPGUARD_CONFIG": str(self.config), "SNAPGUARD_STATE_DIR": str(self.state_dir),
                **(extra or {})}

    def _workload_env(self, take_dir: str) -> dict[str, str]:
        env = {"PYTHONWARNINGS": "ignore"}
        if self.hook:
            env.update(PYTHONPATH=os.pathsep.join([site_dir(), product_root()]), SNAPGUARD_TAKE_DIR=take_dir)
        return env

    def _run(self, argv: list[str], extra_env: dict[str, str] | None, name: str) -> subprocess.CompletedProcess[str]:
        """Run a command of snapguard's with its output in files (not pipes: a process it leaves
        behind, or a restored workload, must not hold the test's pipes open)."""
        self._calls += 1
        out = self.workdir / f"{self._calls:02d}-{name}.out"
        err = self.workdir / f"{self._calls:02d}-{name}.err"
        with open(out, "w") as fo, open(err, "w") as fe:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, timeout=self.timeout,
                                  env=self.env(extra_env), check=False)
        return subprocess.CompletedProcess(argv, proc.returncode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))

    # -- the interface ---------------------------------------------------------------------------

    def start(self, lines: int = 10) -> None:
        raise NotImplementedError

    def checkpoint(self, images: Path, work: Path, leave_running: bool = False,
                   extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        raise NotImplementedError

    def restore(self, images: Path, work: Path,
                extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        raise NotImplementedError

    def pid(self) -> int | None:
        """The workload's root process as the host sees it, None when there is none."""
        raise NotImplementedError

    def alive(self) -> bool:
        return _alive(self.pid())

    def stop(self) -> None:
        raise NotImplementedError

    def record_dir(self, images: Path, work: Path) -> Path:
        """Where this entry point writes snapguard-result.json."""
        raise NotImplementedError

    def record(self, images: Path, work: Path) -> dict[str, Any] | None:
        path = self.record_dir(images, work) / RESULT_NAME
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None

    def values(self) -> list[tuple[int, int]]:
        return self.log.values()

    def advancing(self, lines: int = 5, timeout: float = 10.0) -> bool:
        """The counter writes `lines` more lines within `timeout` seconds."""
        try:
            self.log.wait_for(len(self.log.values()) + lines, timeout)
        except TimeoutError:
            return False
        return True

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class BareTarget(Target):
    """The workload as a plain process tree (its own session), snapshotted by `snapguard`."""

    kind = "bare"

    def __init__(self, workdir: Path, **kw: Any) -> None:
        super().__init__(workdir, **kw)
        self.proc: subprocess.Popen[bytes] | None = None
        self.restored_pid: int | None = None

    def start(self, lines: int = 10) -> None:
        take_dir = self.workdir / "take"
        take_dir.mkdir(mode=0o700, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-c", self.script, str(self.log.path)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, env={**os.environ, **self._workload_env(str(take_dir))})
        self.log.wait_for(lines, timeout=60)

    def pid(self) -> int | None:
        if self.restored_pid is not None:
            return self.restored_pid
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        if self.restored_pid is None and self.proc is not None:
            self.proc.poll()  # reap it if CRIU stopped it: an unreaped child is a zombie
        return super().alive()

    def record_dir(self, images: Path, work: Path) -> Path:
        return images

    def checkpoint(self, images: Path, work: Path, leave_running: bool = False,
                   extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        pid = self.pid()
        assert pid is not None, "start the target first"
        argv = [snapguard_path(), "checkpoint", "--pid", str(pid), "--images", str(images), "--json"]
        out = self._run(argv + (["--leave-running"] if leave_running else []), extra_env, "checkpoint")
        if self.restored_pid is None and self.proc is not None:
            self.proc.poll()
        return out

    def restore(self, images: Path, work: Path,
                extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        if self.proc is not None:
            self.proc.poll()  # the stopped original must be reaped, or its pid is taken
        out = self._run([snapguard_path(), "restore", "--images", str(images), "--json"], extra_env, "restore")
        if out.returncode == 0:
            self.restored_pid = int(json.loads(out.stdout)["pid"])
        return out

    def stop(self) -> None:
        for pid in (self.restored_pid, self.proc.pid if self.proc is not None else None):
            if pid and _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


class RuncTarget(Target):
    """The workload in a runc container driven directly through snapguard-runc."""

    kind = "runc"
    HOST_DIRS = ["/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc"]

    def __init__(self, workdir: Path, **kw: Any) -> None:
        super().__init__(workdir, **kw)
        self.root = workdir / "runc-root"
        self.bundle = workdir / "bundle"
        self.runc_log = workdir / "runc-log.json"
        self.pid_file = workdir / "container.pid"
        self.container_id = f"sg-{os.getpid()}-{abs(hash(str(workdir))) % 10**8}"
        self.started = False

    def _executor(self) -> list[str]:
        # as containerd's shim calls runc: --root, and a JSON --log it reads failures from
        return [snapguard_runc_path(), "--root", str(self.root), "--log", str(self.runc_log), "--log-format", "json"]

    def start(self, lines: int = 10) -> None:
        dirs = [*self.HOST_DIRS, sys.base_prefix, sys.prefix, product_root()]
        env = ["PATH=/usr/bin:/bin", "HOME=/root",
               *(f"{k}={v}" for k, v in self._workload_env("/run/snapguard/take").items())]
        host_bundle(self.bundle, [sys.executable, "-c", self.script, "/out/counter.log"], env,
                    list(dict.fromkeys(dirs)), writable={"/out": str(self.out)}, devices=self.devices)
        # stdio /dev/null, as containerd's null IO: a host file as stdio is outside the
        # container's mounts and CRIU could not dump it
        run = subprocess.run([*self._executor(), "run", "--detach", "--bundle", str(self.bundle), "--pid-file",
                              str(self.pid_file), self.container_id], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60, env=self.env())
        if run.returncode != 0:
            raise RuntimeError(f"runc run exited {run.returncode}: {self.runc_log_messages()[-1:]}")
        self.started = True
        self.log.wait_for(lines, timeout=60)

    def state(self) -> dict[str, Any] | None:
        """`runc state` of the container, None when runc does not know it."""
        out = subprocess.run([RUNC, "--root", str(self.root), "state", self.container_id], capture_output=True,
                             text=True, timeout=30, check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def pid(self) -> int | None:
        state = self.state()
        return int(state["pid"]) if state and state.get("pid") else None

    def alive(self) -> bool:
        state = self.state()
        return state is not None and state.get("status") == "running" and _alive(state.get("pid"))

    def record_dir(self, images: Path, work: Path) -> Path:
        return work

    def checkpoint(self, images: Path, work: Path, leave_running: bool = False,
                   extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        argv = [*self._executor(), "checkpoint", "--image-path", str(images), "--work-path", str(work)]
        return self._run(argv + (["--leave-running"] if leave_running else []) + [self.container_id], extra_env,
                         "checkpoint")

    def restore(self, images: Path, work: Path,
                extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        state = self.state()
        if state is not None and state.get("status") == "stopped":
            self._delete()  # a stop checkpoint leaves nothing running: the id is free again
        argv = [*self._executor(), "restore", "--image-path", str(images), "--work-path", str(work), "--bundle",
                str(self.bundle), "--detach", "--pid-file", str(self.pid_file), self.container_id]
        out = self._run(argv, extra_env, "restore")
        if out.returncode == 0:
            self.started = True
        return out

    def runc_log_messages(self) -> list[str]:
        """The `msg` of each line snapguard-runc (or runc) wrote to --log."""
        try:
            lines = self.runc_log.read_text().splitlines()
        except FileNotFoundError:
            return []
        msgs = []
        for line in lines:
            try:
                msgs.append(json.loads(line)["msg"])
            except (ValueError, KeyError, TypeError):
                continue
        return msgs

    def _delete(self) -> None:
        state = self.state()
        if state is not None and state.get("status") == "paused":
            subprocess.run([RUNC, "--root", str(self.root), "resume", self.container_id], capture_output=True,
                           timeout=30, check=False)
        subprocess.run([RUNC, "--root", str(self.root), "delete", "--force", self.container_id], capture_output=True,
                       timeout=60, check=False)

    def stop(self) -> None:
        if self.started:
            self._delete()
        if self.bundle.exists():
            release_mounts(self.bundle)


def make_target(kind: str, workdir: Path, **kw: Any) -> Target:
    """A target of `kind` ("bare" or "runc"), not started."""
    cls = {"bare": BareTarget, "runc": RuncTarget}[kind]
    return cls(workdir, **kw)


def image_files(images: Path) -> dict[str, int]:
    """{name: mode} of the entries of an image directory (lstat: links are not followed)."""
    return {p.name: stat.S_IMODE(os.lstat(p).st_mode) for p in images.iterdir()} if images.exists() else {}


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _alive(p)]
    return left
