"""A container end to end through the reclaim path, with real runc and CRIU: registered with the
agent (`snapguard protect --container`), snapshotted (stopped) on a notice and streamed into a
file:// store, then restored from the store by `snapguard-runc restore --from` (fetched, verified
as written, fenced), its counter going on from where it stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapguard.names import RESULT_NAME
from snapguard_lab.targets import RuncTarget, typed_lines

EXE = os.path.join(os.path.dirname(sys.executable), "snapguard")
pytestmark = pytest.mark.stack  # runc, CRIU


def journal(target: RuncTarget) -> list[dict]:
    path = target.state_dir / "agent" / "journal.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_agent_snapshots_a_container_and_snapguard_runc_restores_it_from_the_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    url = f"file://{store}"
    with RuncTarget(tmp_path / "node") as t:
        t.start()
        env = t.env()

        def sg(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=180, env=env)

        out = sg("protect", "--container", t.container_id, "--root", str(t.root), "--job", "ctr-job")
        assert out.returncode == 0, out.stderr
        assert sg("notice", "--reason", "test reclaim", "--queue").returncode == 0
        out = sg("agent", "--once", "--store", url)
        assert out.returncode == 0, out.stderr
        kinds = [e["event"] for e in journal(t)]
        assert kinds.index("upload_started") < kinds.index("snapshot_sealed") < kinds.index("uploaded"), out.stderr
        assert not t.alive()  # a stopping snapshot
        before = t.values()
        t._delete()

        # snapguard's own flags must come first after the verb, and need --from
        refused = ["--image-path", str(tmp_path / "refused"), "--work-path", str(tmp_path / "refused")]
        late = t._run([*t._executor(), "restore", *refused, "--bundle", str(t.bundle), "--from", url, t.container_id],
                      None, "restore-late-flag")
        assert late.returncode != 0 and any("USAGE_ERROR" in m for m in t.runc_log_messages()), late.stderr
        lone = t._run([*t._executor(), "restore", "--from-job", "ctr-job", *refused, "--bundle", str(t.bundle),
                       t.container_id], None, "restore-lone-job")
        assert lone.returncode != 0 and "--from-job and --from-image need --from" in t.runc_log_messages()[-1]

        work = tmp_path / "work"
        argv = [*t._executor(), "restore", "--from", url, "--from-job", "ctr-job",
                "--image-path", str(tmp_path / "pulled"), "--work-path", str(work), "--bundle", str(t.bundle),
                "--detach", "--pid-file", str(t.pid_file), t.container_id]
        out = t._run(argv, None, "restore-from")
        assert out.returncode == 0, (out.stderr, t.runc_log_messages()[-3:], typed_lines(out.stderr))
        t.started = True
        assert t.advancing(), "the restored counter does not count"
        after = t.values()
        assert after[:len(before)] == before and after[len(before)][0] == before[-1][0] + 1
        record = json.loads((work / RESULT_NAME).read_text())
        assert record["ok"] and record["fence_epoch"] == 1 and record["job"] == "ctr-job"
        assert record["fetch"]["bytes"] > 0
        # the host checks ran while the image was fetched, and the preflight reused them
        assert {"host_checks_s", "host_checks_wait_s"} <= set(record["timings"]), record["timings"]
        # the store now holds epoch 1: the old node's late push of its image is refused
        images = [e for e in journal(t) if e["event"] == "snapshot_sealed"][0]["image"]
        old_node = {**env, "SNAPGUARD_STATE_DIR": str(tmp_path / "old-node-state")}  # it never saw epoch 1
        out = subprocess.run([EXE, "push", "--images", images, "--store", url, "--job", "ctr-job"], capture_output=True,
                             text=True, timeout=180, env=old_node)
        assert out.returncode == 1 and out.stderr.startswith("snapguard FENCED: "), out.stderr


def test_snapguard_runc_restore_from_refused_after_the_fetch_names_the_file_checkpoint(
        snapguard_runc: str, tmp_path: Path) -> None:
    """A restore --from whose image is fetched and fenced but whose restore then fails (here runc
    finds no bundle) names the job's file checkpoint registered in the store, for the caller's
    fallback."""
    from snapguard import image
    from snapguard.procfs import host_facts
    from snapguard.store import open_store

    sealed = tmp_path / "sealed"
    sealed.mkdir(mode=0o700)
    (sealed / "pages-1.img").write_bytes(os.urandom(4096))
    image.seal(str(sealed), {"criu_version": "4.2.1", "host": host_facts(), "processes": []})
    store = open_store(f"file://{tmp_path / 'store'}")
    store.push(str(sealed), "fb-job")
    store.register_file_checkpoint("fb-job", "/ckpt/fb-job/step-100")
    config = tmp_path / "config.toml"
    config.write_text("")
    env = {**os.environ, "SNAPGUARD_CONFIG": str(config), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")}
    work, log = tmp_path / "work", tmp_path / "runc-log.json"
    out = subprocess.run([snapguard_runc, "--log", str(log), "--log-format", "json", "restore", "--from", store.url,
                          "--from-job", "fb-job", "--image-path", str(tmp_path / "pulled"), "--work-path", str(work),
                          "--bundle", str(tmp_path / "no-bundle"), "c-fallback"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1, out.stderr
    record = json.loads((work / RESULT_NAME).read_text())
    # refused by the restore itself: the epoch it took right before runc's restore is rolled back,
    # so a live copy of the job elsewhere is not fenced by an attempt that never ran
    assert (record["ok"], record["phase"], store.current_epoch("fb-job")) == (False, "restore", 0), record
    assert record["evidence"]["epoch_rolled_back"]["epoch"] == 1, record
    assert record["evidence"].get("file_checkpoint") == "/ckpt/fb-job/step-100", record
    assert record["evidence"]["job"] == "fb-job", record


def test_agent_protects_containers_annotated_in_containerd(containerd, snapguard_runc: str, tmp_path: Path) -> None:
    """Containers annotated snapguard.io/job, found through containerd's API, join the registry
    (the others and a malformed one do not), and a notice snapshots them through runc's root of
    containerd's shim into the store."""
    from snapguard_lab.testbed import COUNTER_IMAGE

    containerd.import_counter_image()
    ids = {"job": f"sg-annot-{os.getpid()}", "plain": f"sg-plain-{os.getpid()}", "bad": f"sg-bad-{os.getpid()}"}
    notes = {"job": ["--annotation", "snapguard.io/job=annotated-job",
                     "--annotation", "snapguard.io/file-checkpoint=/ckpt/annotated.pt"],
             "plain": [], "bad": ["--annotation", "snapguard.io/job=../escape"]}
    for what, cid in ids.items():
        out_dir = tmp_path / f"out-{what}"
        out_dir.mkdir()
        containerd.ctr("run", "-d", "--null-io", "--snapshotter", "native", "--runc-binary", snapguard_runc,
                       *notes[what], "--mount", f"type=bind,src={out_dir},dst=/out,options=rbind:rw",
                       COUNTER_IMAGE, cid)
    try:
        config = tmp_path / "config.toml"
        config.write_text(f'runc = "{containerd.runc}"\n')
        env = {**os.environ, "SNAPGUARD_CONFIG": str(config), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")}
        store = tmp_path / "store"
        store.mkdir(mode=0o700)
        agent = [EXE, "agent", "--once", "--containerd", "--containerd-address", containerd.socket,
                 "--containerd-namespace", containerd.namespace, "--ctr", containerd.stack.ctr,
                 "--store", f"file://{store}"]
        out = subprocess.run(agent, capture_output=True, text=True, timeout=180, env=env)
        assert out.returncode == 0, out.stderr
        assert f"{ids['bad']}: snapguard.io/job '../escape' is not a job name" in out.stderr
        listed = json.loads(subprocess.run([EXE, "protect", "--list", "--json"], capture_output=True, text=True,
                                           timeout=60, env=env).stdout)
        assert sorted(listed) == [f"container:{ids['job']}"], listed
        entry = listed[f"container:{ids['job']}"]
        assert (entry["job"], entry["file_checkpoint"], entry["source"], entry["root"]) == \
            ("annotated-job", "/ckpt/annotated.pt", "containerd", containerd.runc_root)

        assert subprocess.run([EXE, "notice", "--reason", "drain", "--queue"], env=env, timeout=60).returncode == 0
        out = subprocess.run(agent, capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr
        from snapguard.store import open_store

        refs = open_store(f"file://{store}").images("annotated-job")
        assert len(refs) == 1 and refs[0].complete, out.stderr
        deadline = time.monotonic() + 30
        while containerd.task_status(ids["job"]) not in (None, "STOPPED") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert containerd.task_status(ids["job"]) in (None, "STOPPED")  # a stopping snapshot
        assert containerd.task_status(ids["plain"]) == "RUNNING"  # not annotated: untouched
    finally:
        for cid in ids.values():
            containerd.remove(cid)
