"""`snapguard agent` end to end with real CRIU: a protected bare counter snapshotted (stopped) on an
AWS spot notice served by a loopback IMDSv2, once however often the notice is read; `snapguard
notice` triggers it; an agent killed mid-snapshot leaves no marked partial image, and once
restarted the workload is snapshotted (or still running)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapguard import image
from snapguard_lab.metadata_servers import AwsImds
from snapguard_lab.targets import COUNTER, CRIU

EXE = os.path.join(os.path.dirname(sys.executable), "snapguard")


def snapguard(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120, env={**os.environ, **env})


def wait_for(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError(what)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    if os.geteuid() != 0:
        pytest.fail("the agent's tests need root (CRIU)")
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    return {"SNAPGUARD_CONFIG": str(cfg), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")}


@pytest.fixture
def counters(tmp_path: Path):
    procs = []

    def start(name: str) -> subprocess.Popen[bytes]:
        log = tmp_path / f"{name}.log"
        p = subprocess.Popen([sys.executable, "-c", COUNTER, str(log)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        procs.append(p)
        wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 3, 30, f"{name} counting")
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


class AgentProc:
    def __init__(self, tmp_path: Path, env: dict[str, str], *args: str) -> None:
        self.state = Path(env["SNAPGUARD_STATE_DIR"]) / "agent"
        self.log = tmp_path / f"agent-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen([EXE, "agent", "--interval", "0.3", *args], env={**os.environ, **env},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=open(self.log, "wb"), start_new_session=True)

    def journal(self) -> list[dict]:
        try:
            return [json.loads(x) for x in (self.state / "journal.jsonl").read_text().splitlines() if x.strip()]
        except (FileNotFoundError, ValueError):
            return []

    def events(self, name: str) -> list[dict]:
        return [e for e in self.journal() if e["event"] == name]

    def wait_event(self, name: str, n: int = 1, timeout: float = 60) -> list[dict]:
        return wait_for(lambda: len(self.events(name)) >= n and self.events(name), timeout,
                        f"{n} x {name} in the journal; log: {self.text()[-2000:]}")

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def images_in(state: Path) -> list[Path]:
    d = state / "images"
    return sorted(p for p in d.iterdir() if p.is_dir()) if d.exists() else []


def test_aws_notice_snapshots_once_and_local_notice_triggers(tmp_path: Path, env: dict[str, str], counters) -> None:
    first = counters("first")
    out = snapguard("protect", "--pid", str(first.pid), "--job", "train-a", "--file-checkpoint",
                    str(tmp_path / "ckpt.pt"), env=env)
    assert out.returncode == 0, out.stderr
    listed = json.loads(snapguard("protect", "--list", "--json", env=env).stdout)
    assert listed[f"pid:{first.pid}"]["job"] == "train-a" and listed[f"pid:{first.pid}"]["state"] == "protected"
    with AwsImds() as imds:
        agent = AgentProc(tmp_path, env, "--source", "aws", "--aws-url", imds.url)
        try:
            agent.wait_event("agent_started")
            time.sleep(1)
            assert not agent.events("noticed") and first.poll() is None  # no notice: nothing touched
            imds.arm("terminate", lead_s=120)
            sealed = agent.wait_event("snapshot_sealed")
            img = Path(sealed[0]["image"])
            assert (img / image.MARKER_NAME).exists() and (img / image.MANIFEST_NAME).exists()
            assert os.stat(img).st_mode & 0o777 == 0o700
            first.wait(timeout=10)  # a stopping snapshot: the workload is gone
            noticed = agent.events("noticed")[0]
            assert noticed["source"] == "aws" and 100 < noticed["lead_s"] <= 120
            polls = sum(1 for _, p in imds.requests if p.endswith("instance-action"))
            wait_for(lambda: sum(1 for _, p in imds.requests if p.endswith("instance-action")) >= polls + 4, 20,
                     "more polls of the same notice")
            # the same notice, read again and again: one snapshot
            assert len(agent.events("noticed")) == 1 and len(agent.events("snapshot_started")) == 1
            assert json.loads(snapguard("protect", "--list", "--json", env=env).stdout)[
                f"pid:{first.pid}"]["state"] == "snapshotted"
            # no store configured: the image stays local, and says so
            assert "store none" in agent.text()

            # an operator's notice (a drain) through `snapguard notice` snapshots what is protected now
            second = counters("second")
            assert snapguard("protect", "--pid", str(second.pid), "--job", "train-b", env=env).returncode == 0
            out = snapguard("notice", "--reason", "drain for maintenance", "--id", "drain-7", "--json", env=env)
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["id"] == "drain-7"
            agent.wait_event("snapshot_sealed", 2)
            second.wait(timeout=10)
            assert snapguard("notice", "--id", "drain-7", env=env).returncode == 0  # the same id again
            wait_for(lambda: not any((agent.state / "inbox").iterdir()), 10, "inbox consumed")
            assert len(agent.events("snapshot_started")) == 2 and len(agent.events("noticed")) == 2
        finally:
            agent.stop()
    assert agent.proc.returncode == 0, agent.text()[-2000:]
    marked = [p for p in images_in(agent.state) if (p / image.MARKER_NAME).exists()]
    assert len(marked) == 2 and len(images_in(agent.state)) == 2


def slow_criu(path: Path, pids: Path, delay_s: float) -> Path:
    """A root-only stand-in for CRIU whose dump sleeps first (its pid noted), then runs the real one."""
    path.write_text("#!/bin/sh\n"
                    'case "$1" in\n'
                    f'  dump) echo $$ >> "{pids}"; sleep {delay_s} ;;\n'
                    "esac\n"
                    f'exec "{CRIU}" "$@"\n')
    os.chmod(path, 0o700)
    return path


def test_agent_killed_mid_snapshot_then_restarted(tmp_path: Path, env: dict[str, str], counters) -> None:
    pids = tmp_path / "criu.pids"
    wrapper = slow_criu(tmp_path / "criu", pids, 4)
    Path(env["SNAPGUARD_CONFIG"]).write_text(f'criu = "{wrapper}"\n')
    job = counters("job")
    assert snapguard("protect", "--pid", str(job.pid), "--job", "train-c", env=env).returncode == 0
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    agent = AgentProc(tmp_path, env, "--store", f"file://{store}")  # streaming: the upload began too
    try:
        agent.wait_event("agent_started")
        assert snapguard("notice", "--reason", "spot", env=env).returncode == 0
        started = agent.wait_event("snapshot_started")
        img = Path(started[0]["image"])
        wait_for(pids.exists, 30, "the slow CRIU started")
        time.sleep(0.5)
        agent.proc.send_signal(signal.SIGKILL)  # mid-snapshot: CRIU (its own process group) lives on
        agent.proc.wait()
    finally:
        agent.stop()
    stray = int(pids.read_text().split()[0])
    assert os.path.exists(f"/proc/{stray}")  # the orphaned CRIU still waits to dump
    assert not (img / image.MARKER_NAME).exists()
    assert job.poll() is None  # still running

    # the restart settles it: the stray CRIU is killed, the unmarked image discarded, the notice
    # (still open) acted on again
    again = subprocess.run([EXE, "agent", "--once", "--store", f"file://{store}"], env={**os.environ, **env},
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert not os.path.exists(f"/proc/{stray}") or "Z" in Path(f"/proc/{stray}/stat").read_text().split()[2]
    assert "snapguard AGENT_SNAPSHOT_INTERRUPTED: " in again.stderr
    events = [json.loads(x) for x in (agent.state / "journal.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert "snapshot_interrupted" in kinds and "discarded" in kinds
    interrupted = next(e for e in events if e["event"] == "snapshot_interrupted")
    assert interrupted["record"]["reason"] == "AGENT_SNAPSHOT_INTERRUPTED" and interrupted["record"]["workload_intact"]
    # no marked partial image anywhere; the workload is either snapshotted or still running
    for p in images_in(agent.state):
        assert (p / image.MARKER_NAME).exists()
        assert image.verify(str(p)) if hasattr(image, "verify") else True
    snapshotted = [p for p in images_in(agent.state) if (p / image.MARKER_NAME).exists()]
    job_done = job.poll() is not None or (job.wait(timeout=10) is not None)
    assert (snapshotted and job_done) or (not snapshotted and job.poll() is None)
    assert kinds.count("snapshot_sealed") == 1 and "notice_done" in kinds[kinds.index("snapshot_sealed"):]
    # the upload the killed agent began was swept from the store; the new snapshot's is whole
    assert kinds.index("upload_swept") < kinds.index("snapshot_sealed")
    from snapguard.store import open_store

    whole = open_store(f"file://{store}").images("train-c", whole_only=False)
    assert [r.complete for r in whole] == ([True] if snapshotted else [])
    assert not [p for p in store.rglob(".tmp-*")]


def _idle_counter(tmp_path: Path) -> int:
    log = tmp_path / "older.log"
    p = subprocess.Popen([sys.executable, "-c", COUNTER, str(log)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 3, 30, "the older counter")
    return p.pid


def test_once_streams_into_a_file_store(tmp_path: Path, env: dict[str, str]) -> None:
    """The image goes to the store while CRIU writes it: a workload with 512 MiB of memory, whose
    pages file passes several 64 MiB spans during the dump; the marker only after the seal."""
    store_mod = pytest.importorskip("snapguard.store")
    log = tmp_path / "up.log"
    job = subprocess.Popen([sys.executable, "-c", "import os\nblob = os.urandom(512 << 20)\n" + COUNTER, str(log)],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 3, 60, "the workload counting")
    assert snapguard("protect", "--pid", str(job.pid), "--job", "train-d", env=env).returncode == 0
    assert snapguard("notice", "--reason", "test", "--queue", env=env).returncode == 0
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    open_store = store_mod.open_store
    older = tmp_path / "older"  # an older image of the job, which --keep 1 prunes after the upload
    assert snapguard("checkpoint", "--pid", str(_idle_counter(tmp_path)), "--images", str(older), env=env).returncode == 0
    open_store(f"file://{store}").push(str(older), "train-d", name="20200101T000000.000000Z")
    out = subprocess.run([EXE, "agent", "--once", "--store", f"file://{store}", "--keep", "1"],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    job.wait(timeout=10)
    events = [json.loads(x) for x in (Path(env["SNAPGUARD_STATE_DIR"]) / "agent" / "journal.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds.index("upload_started") < kinds.index("snapshot_sealed") < kinds.index("uploaded"), out.stderr
    uploaded = events[kinds.index("uploaded")]
    assert uploaded["streaming"] and uploaded["streamed_bytes"] >= store_mod.SPAN and uploaded["resent"] == []
    # the upload's lines name the notice the snapshot was taken for, as the snapshot's do
    notice_id = events[kinds.index("snapshot_sealed")]["notice"]
    assert notice_id and events[kinds.index("upload_started")]["notice"] == uploaded["notice"] == notice_id
    refs = store_mod.open_store(f"file://{store}").images("train-d")
    assert len(refs) == 1 and refs[0].complete and refs[0].name != "20200101T000000.000000Z"  # pruned
    assert "pruned" in kinds
    pulled = store_mod.open_store(f"file://{store}").pull(refs[0], str(tmp_path / "pulled"))
    assert pulled.bytes > (512 << 20)


def test_typed_errors(tmp_path: Path, env: dict[str, str]) -> None:
    from tests.unit.test_notice_sources import dead_url

    out = snapguard("protect", "--pid", str(2**22 + 11), "--job", "x", env=env)
    assert out.returncode == 1 and out.stderr.startswith("snapguard PROCESS_NOT_FOUND: "), out.stderr
    out = snapguard("protect", "--pid", "1", env=env)
    assert out.returncode == 2 and out.stderr.startswith("snapguard USAGE_ERROR: ")
    out = snapguard("agent", "--once", "--source", "k8s", "--k8s-node", "", env=env)
    assert out.returncode == 2 and out.stderr.startswith("snapguard USAGE_ERROR: "), out.stderr
    out = snapguard("agent", "--once", "--source", "aws", "--aws-url", dead_url(), "--interval", "1", env=env)
    assert out.returncode == 1 and "snapguard NOTICE_SOURCE_UNAVAILABLE: aws notice source" in out.stderr
    assert "Traceback" not in out.stderr
    out = snapguard("protect", "--remove", "--pid", "12345", env=env)
    assert out.returncode == 2 and "not registered" in out.stderr


# -- warm host checks (issue 13): the snapshot on a notice reuses the agent's recent ones --------

def counting_criu(root: Path) -> tuple[Path, Path]:
    """A root-only stand-in for CRIU that records each verb with its pid (`check 123`), and whose
    `check` sleeps 8 s first while the file `hang` beside it exists."""
    record, hang = root / "criu-calls", root / "hang"
    path = root / "criu"
    path.write_text("#!/bin/sh\n"
                    f'echo "$1 $$" >> "{record}"\n'
                    f'if [ "$1" = check ] && [ -e "{hang}" ]; then sleep 8; fi\n'
                    f'exec "{CRIU}" "$@"\n')
    os.chmod(path, 0o700)
    return path, record


def criu_checks(record: Path) -> list[int]:
    """The pids of the `criu check` runs so far."""
    text = record.read_text() if record.exists() else ""
    return [int(line.split()[1]) for line in text.splitlines() if line.split()[:1] == ["check"]]


def test_checkpoint_reuses_host_checks_run_before(tmp_path: Path, env: dict[str, str], counters,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """pipeline.checkpoint_pid(..., host_checks=) with real CRIU: the host checks that passed are
    not run again (NVML's inventory is), the timings say how old they were; without them the
    preflight runs them itself and the timings have no host_checks_age_s."""
    from snapguard import pipeline, preflight
    from snapguard.config import load
    from snapguard.preflight import gpu, host

    config = load(env)
    seen: list[str] = []
    for name, fn in (("check_privileges", host.check_privileges), ("check_criu", host.check_criu)):
        monkeypatch.setattr(host, name, lambda *a, _n=name, _f=fn: seen.append(_n) or _f(*a))
    monkeypatch.setattr(gpu, "gpu_facts", lambda _f=gpu.gpu_facts: seen.append("nvml") or _f())
    warm = preflight.host_checks_ahead(config)
    assert seen == ["check_privileges", "check_criu", "nvml"]
    time.sleep(0.2)
    seen.clear()
    result = pipeline.checkpoint_pid(counters("a").pid, str(tmp_path / "img-a"), config, host_checks=warm)
    assert seen == ["nvml"], seen  # the CUDA pids come from a fresh inventory
    assert 0.2 <= result["timings"]["host_checks_age_s"] < 30, result["timings"]
    seen.clear()
    result = pipeline.checkpoint_pid(counters("b").pid, str(tmp_path / "img-b"), config)
    assert seen == ["check_privileges", "check_criu", "nvml"] and "host_checks_age_s" not in result["timings"]


def protected_with_counting_criu(tmp_path: Path, env: dict[str, str], counters, job_name: str):
    """A counter protected as `job_name`, under a config whose CRIU counts its `check` runs."""
    wrapper, record = counting_criu(tmp_path)
    Path(env["SNAPGUARD_CONFIG"]).write_text(f'criu = "{wrapper}"\n')
    job = counters("job")
    assert snapguard("protect", "--pid", str(job.pid), "--job", job_name, env=env).returncode == 0
    return record, job


def test_agent_snapshot_on_notice_reuses_the_warm_host_checks(tmp_path: Path, env: dict[str, str], counters) -> None:
    """The running agent runs the host checks at start; the snapshot on a notice reuses them: its
    preflight runs no `criu check` (the on-disk pass cache removed, so a preflight that ran the
    CRIU check would run it), and the journal's snapshot_sealed timings carry host_checks_age_s."""
    record, job = protected_with_counting_criu(tmp_path, env, counters, "train-w")
    agent = AgentProc(tmp_path, env, "--host-checks-every", "60")
    try:
        warm = agent.wait_event("host_checks")[0]
        assert warm["checks"]["criu"] == "ok" and warm["checks"]["privileges"] == "ok", warm
        assert len(criu_checks(record)) == 1  # the warm run's
        (Path(env["SNAPGUARD_STATE_DIR"]) / "criu-check.json").unlink()
        assert snapguard("notice", "--reason", "spot", env=env).returncode == 0
        sealed = agent.wait_event("snapshot_sealed")[0]
        job.wait(timeout=10)
        assert len(criu_checks(record)) == 1, record.read_text()  # the snapshot's preflight ran none
        age = sealed["timings"]["host_checks_age_s"]
        assert 0 < age < 60, sealed["timings"]
        # the log line follows the journal's snapshot_sealed: waited for, not read at once
        wait_for(lambda: "host checks of" in agent.text(), 10, "the sealed line naming the reused host checks")
        assert len(agent.events("host_checks")) == 1
    finally:
        agent.stop()
    assert agent.proc.returncode == 0, agent.text()[-2000:]


def test_agent_snapshot_does_not_use_stale_host_checks(tmp_path: Path, env: dict[str, str], counters) -> None:
    """--host-checks-every 1: a result older than 2 s is not used. The agent's second run hangs
    (its `criu check` sleeps), so on the notice the newest result is stale: the snapshot's
    preflight runs the checks itself (a `criu check` of its own), its timings have no
    host_checks_age_s, and the hung run does not hold up the notice; the agent still stops."""
    record, job = protected_with_counting_criu(tmp_path, env, counters, "train-s")
    agent = AgentProc(tmp_path, env, "--host-checks-every", "1")
    try:
        first = agent.wait_event("host_checks")[0]
        (tmp_path / "hang").touch()
        (Path(env["SNAPGUARD_STATE_DIR"]) / "criu-check.json").unlink()
        wait_for(lambda: len(criu_checks(record)) >= 2, 10, "the warm run's second `criu check`")
        (tmp_path / "hang").unlink()  # only that one hangs (8 s)
        time.sleep(max(0.0, first["t"] + 2.5 - time.time()))  # the first result is now over 2 s old
        t = time.monotonic()
        assert snapguard("notice", "--reason", "spot", env=env).returncode == 0
        sealed = agent.wait_event("snapshot_sealed")[0]
        took = time.monotonic() - t
        job.wait(timeout=10)
        assert "host_checks_age_s" not in sealed["timings"], sealed["timings"]
        assert len(criu_checks(record)) == 3, record.read_text()  # the snapshot ran its own
        assert took < 7, took  # not held up by the hung warm run
        t = time.monotonic()
    finally:
        agent.stop()
        for pid in criu_checks(record)[1:2]:  # the hung check (a process group of its own) this test made
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    assert agent.proc.returncode == 0, agent.text()[-2000:]
    assert time.monotonic() - t < 15
