"""Image stores (snapguard.store): file:// and s3:// (a real radosgw started here), the whole-image
rule, verify-while-read, fencing epochs, and restore --from on another "node" (a network namespace)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from snapguard import image
from snapguard.reasons import Reason, SnapguardError
from snapguard.store import SPAN, Progress, SpanHasher, open_store
from snapguard_lab.counter import node_env, values, wait_lines
from snapguard_lab.targets import COUNTER
from snapguard_lab.testbed import MODULUS, expected_hash

pytest_plugins = ("snapguard_lab.s3",)  # rgw, rgw_nodes: one real radosgw for the session

SNAPGUARD = os.path.join(os.path.dirname(sys.executable), "snapguard")
pytestmark = pytest.mark.root  # CRIU, network namespaces


def snapguard(*args: str, env: dict[str, str], preexec=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([SNAPGUARD, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env}, preexec_fn=preexec)


@pytest.fixture(params=["file", "s3"])
def store_url(request, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    gw = request.getfixturevalue("rgw")
    import boto3

    bucket = f"sg-{uuid.uuid4().hex[:12]}"
    boto3.session.Session().client("s3", endpoint_url=gw.endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/snaps"


@pytest.fixture(scope="module")
def sealed(tmp_path_factory) -> Path:
    """A real image: a leave-running snapshot of a counter, taken once for the module."""
    root = tmp_path_factory.mktemp("sealed")
    log = root / "counter.log"
    proc = subprocess.Popen([sys.executable, "-c", COUNTER, str(log)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_lines(log, 5)
        out = snapguard("checkpoint", "--pid", str(proc.pid), "--images", str(root / "img"), "--leave-running",
                        env=node_env(root / "node"))
        assert out.returncode == 0, out.stderr
    finally:
        proc.kill()
        proc.wait()
    return root / "img"


def reason_of(fn) -> Reason:
    with pytest.raises(SnapguardError) as e:
        fn()
    return e.value.reason


def test_span_digest_is_the_manifests(tmp_path: Path) -> None:
    d = tmp_path / "img"
    d.mkdir(mode=0o700)
    sizes = {"empty.img": 0, "one.img": 1, "pages-1.img": SPAN + 5}
    for name, size in sizes.items():
        (d / name).write_bytes(os.urandom(min(size, 1 << 20)) * (size // (1 << 20)) + os.urandom(size % (1 << 20)))
    manifest = image.seal(str(d), {})
    for name in sizes:
        h = SpanHasher()
        data = (d / name).read_bytes()
        for i in range(0, len(data), 7 << 20):  # chunks that straddle the span boundary
            h.update(data[i:i + (7 << 20)])
        assert h.hexdigest() == manifest["files"][name]["sha256"], name


def test_round_trip_verified_while_read(store_url: str, sealed: Path, tmp_path: Path) -> None:
    store = open_store(store_url)
    seen = []
    ref = store.push(str(sealed), "job1", progress=Progress(callback=seen.append))
    assert ref.complete and seen and seen[-1]["bytes"] == seen[-1]["total"] > 0
    assert store.newest("job1") == ref.__class__(store.url, "job1", ref.name, True, 0)
    pulled = store.pull(ref, str(tmp_path / "dest"))
    assert image.verify(pulled.image_dir).to_json()["files"] == image.verify(str(sealed)).to_json()["files"]
    assert pulled.digests == {n: e["sha256"] for n, e in pulled.manifest["files"].items()}
    assert os.stat(pulled.image_dir).st_mode & 0o777 == 0o700
    for f in Path(pulled.image_dir).iterdir():
        assert f.stat().st_mode & 0o777 == 0o600 and f.read_bytes() == (sealed / f.name).read_bytes()
    # the CLI: pull into another directory, by the job's only image
    out = snapguard("pull", "--store", store_url, "--images", str(tmp_path / "cli"), "--json", env=node_env(tmp_path))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["image"] == ref.name and (tmp_path / "cli" / image.MARKER_NAME).exists()


KILLER = """
import os, signal, sys
from snapguard.store import Progress, open_store
def kill(n):
    if n > (256 << 10):
        os.kill(os.getpid(), signal.SIGKILL)
open_store(sys.argv[1]).push(sys.argv[2], "job1", name="killed", progress=Progress(on_bytes=kill))
"""


def test_upload_killed_half_way_is_never_marked(store_url: str, sealed: Path, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", KILLER, store_url, str(sealed)], capture_output=True, timeout=60)
    assert out.returncode == -9, out.stderr
    store = open_store(store_url)
    partial = store.images("job1", whole_only=False)
    assert [(r.name, r.complete) for r in partial] == [("killed", False)]
    assert store.images("job1") == [] and store.newest("job1") is None
    assert reason_of(lambda: store.pull("killed", str(tmp_path / "d"), job="job1")) is Reason.UPLOAD_INCOMPLETE
    assert not (tmp_path / "d").exists()
    cli = snapguard("pull", "--store", store_url, "--job", "job1", "--images", str(tmp_path / "d2"),
                    env=node_env(tmp_path))
    assert cli.returncode == 1 and cli.stderr.startswith("snapguard UPLOAD_INCOMPLETE: "), cli.stderr
    # restore --from with a file checkpoint registered: the fallback, exit 3, its path alone on stdout
    store.register_file_checkpoint("job1", "/ckpt/job1/step-100")
    fb = snapguard("restore", "--store", store_url, "--job", "job1", env=node_env(tmp_path / "n"))
    assert fb.returncode == 3, fb.stderr
    assert fb.stdout == "/ckpt/job1/step-100\n"
    assert fb.stderr.startswith("snapguard UPLOAD_INCOMPLETE: ") and "FALLBACK_TO_FILE_CHECKPOINT" in fb.stderr
    # without one: exit 1
    none = snapguard("restore", "--store", store_url, "--job", "job2", env=node_env(tmp_path / "n"))
    assert none.returncode == 1 and none.stderr.startswith("snapguard IMAGE_INCOMPLETE: "), none.stderr


def test_flipped_byte_in_store_refused_before_anything_is_restored(store_url: str, sealed: Path,
                                                                   tmp_path: Path) -> None:
    store = open_store(store_url)
    ref = store.push(str(sealed), "job1")
    pages = max(sealed.glob("pages-*.img"), key=lambda p: p.stat().st_size).name
    key = f"job1/images/{ref.name}/{pages}"
    data = bytearray(store._get(key))
    data[len(data) // 2] ^= 0x01
    if store_url.startswith("file:"):
        path = Path(store.root, *key.split("/"))
        path.write_bytes(bytes(data))
    else:
        store._put(key, bytes(data))
    err = pytest.raises(SnapguardError, store.pull, ref, str(tmp_path / "dest"))
    assert err.value.reason is Reason.IMAGE_CORRUPT and pages in str(err.value)
    assert not (tmp_path / "dest").exists()  # nothing left to restore from
    fb = snapguard("restore", "--store", store_url, "--job", "job1", "--file-checkpoint", "s3://ckpt/job1/7",
                   env=node_env(tmp_path / "n"))
    assert fb.returncode == 3 and fb.stdout == "s3://ckpt/job1/7\n", fb.stderr
    assert fb.stderr.startswith("snapguard IMAGE_CORRUPT: ")


def test_epochs_one_winner_per_number(store_url: str) -> None:
    store = open_store(store_url)
    results: list[object] = []
    barrier = threading.Barrier(8)

    def race(expect):
        barrier.wait()
        try:
            results.append(store.take_epoch("job1", expect=expect))
        except SnapguardError as e:
            results.append(e.reason)

    for expect in (0, None):
        results.clear()
        threads = [threading.Thread(target=race, args=(expect,)) for _ in range(8)]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        if expect == 0:  # eight restores that all saw epoch 0: one gets 1, seven are FENCED
            assert sorted(results, key=str) == [1] + [Reason.FENCED] * 7, results
        else:  # next free number, retried: eight distinct epochs
            assert sorted(results) == list(range(2, 10)), results
    assert store.current_epoch("job1") == 9


def test_stale_snapshot_push_is_fenced_and_writes_nothing(store_url: str, sealed: Path, tmp_path: Path) -> None:
    store = open_store(store_url)
    store.push(str(sealed), "job1", name="old-node-1", epoch=0)
    assert store.take_epoch("job1", expect=0) == 1  # the job was restored elsewhere
    before = store._list("")
    assert reason_of(lambda: store.push(str(sealed), "job1", name="old-node-2", epoch=0)) is Reason.FENCED
    out = snapguard("push", "--images", str(sealed), "--store", store_url, "--job", "job1", env=node_env(tmp_path))
    assert out.returncode == 1 and out.stderr.startswith("snapguard FENCED: "), out.stderr
    assert store._list("") == before
    assert store.push(str(sealed), "job1", name="new-node-1", epoch=1).complete


def _grow(path: Path, chunks: list[bytes], hold: threading.Event | None = None, at: int = 0) -> None:
    """Write the chunks in order; with `hold`, stop after `at` of them until it is set (a
    writer still writing, deterministically)."""
    with open(path, "wb") as f:
        for i, c in enumerate(chunks):
            if hold is not None and i == at:
                assert hold.wait(120)
            f.write(c)
            f.flush()


def _fields(sealed: Path) -> dict:
    """A real manifest's fields, for sealing a directory of made-up files."""
    doc = json.loads((sealed / image.MANIFEST_NAME).read_text())
    return {k: v for k, v in doc.items() if k not in ("schema", "snapguard_version", "epoch", "files", "image_bytes")}


def test_streaming_push_overlaps_the_writer_and_the_manifest_decides(store_url: str, sealed: Path,
                                                                     tmp_path: Path) -> None:
    """Spans go out while their file grows; the sealed manifest is the authority at finish(): a
    file rewritten after its span went out is sent again whole, a file the manifest does not list
    is dropped, and nothing counts before the marker."""
    d = tmp_path / "img"
    d.mkdir(mode=0o700)
    store = open_store(store_url)
    stream = store.stream(str(d), "job-s", name="one")
    pages = [os.urandom(16 << 20) for _ in range(13)]  # 3 spans + 16 MiB
    hold = threading.Event()
    writer = threading.Thread(target=_grow, args=(d / "pages-1.img", pages, hold, 9))
    writer.start()
    # the overlap: two whole spans are in the store while the writer still writes
    deadline = time.monotonic() + 60
    while stream.streamed_bytes < 2 * SPAN and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stream.streamed_bytes == 2 * SPAN and writer.is_alive()
    assert store.newest("job-s") is None
    hold.set()
    writer.join()
    _grow(d / "rewritten.img", [os.urandom(SPAN), os.urandom(1 << 20)])
    _grow(d / "gone.img", [os.urandom(SPAN + 1)])
    (d / "core-1.img").write_bytes(b"small")
    # a take point's spill (snapguard's name, but image bytes written front to back) streams too;
    # snapguard's other files do not
    _grow(d / "snapguard-take-7.bin", [os.urandom(SPAN), os.urandom(4096)])
    _grow(d / "snapguard-other.bin", [os.urandom(SPAN)])
    deadline = time.monotonic() + 60
    while stream.streamed_bytes < 6 * SPAN and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # a scan or two more: snapguard-other.bin must not be sent
    assert stream.streamed_bytes == 6 * SPAN
    os.unlink(d / "snapguard-other.bin")
    with open(d / "rewritten.img", "r+b") as f:  # back over a span already sent
        f.write(b"X" * 4096)
    os.unlink(d / "gone.img")
    assert store.newest("job-s") is None  # nothing marked while the image is unsealed
    manifest = image.seal(str(d), _fields(sealed))
    ref = stream.finish()
    assert ref.complete and stream.resent == ["rewritten.img"]
    assert sorted(manifest["files"]) == ["core-1.img", "pages-1.img", "rewritten.img", "snapguard-take-7.bin"]
    pulled = store.pull(ref, str(tmp_path / "out"))
    for name in manifest["files"]:
        assert (Path(pulled.image_dir) / name).read_bytes() == (d / name).read_bytes(), name
    assert not [k for k in store._list("job-s/") if "gone" in k]


def test_streaming_push_aborted_leaves_nothing_and_is_fenced_first(store_url: str, tmp_path: Path) -> None:
    d = tmp_path / "img"
    d.mkdir(mode=0o700)
    store = open_store(store_url)
    stream = store.stream(str(d), "job-a", name="dies")
    _grow(d / "pages-1.img", [os.urandom(SPAN + 5)])
    deadline = time.monotonic() + 60
    while stream.streamed_bytes < SPAN and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stream.streamed_bytes == SPAN
    stream.abort()  # the dump failed
    assert store._list("job-a/") == [] and store.images("job-a", whole_only=False) == []
    # finish() without a sealed image refuses and leaves nothing either
    stream = store.stream(str(d), "job-a", name="unsealed")
    assert reason_of(stream.finish) is Reason.IMAGE_INCOMPLETE
    assert store._list("job-a/") == []
    assert store.take_epoch("job-a", expect=0) == 1  # restored elsewhere: a late stream sends nothing
    assert reason_of(lambda: store.stream(str(d), "job-a", name="late", epoch=0)) is Reason.FENCED
    assert [k for k in store._list("job-a/") if "/images/" in k] == []


STREAM_KILLED = """
import os, signal, sys, time
from snapguard.store import SPAN, open_store
s = open_store(sys.argv[1]).stream(sys.argv[2], "job-k", name="killed")
with open(os.path.join(sys.argv[2], "pages-1.img"), "wb") as f:
    f.write(os.urandom(SPAN + 7))
while s.streamed_bytes < SPAN:
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_streaming_writer_killed_leaves_nothing_marked_and_is_swept(store_url: str, tmp_path: Path) -> None:
    d = tmp_path / "img"
    d.mkdir(mode=0o700)
    out = subprocess.run([sys.executable, "-c", STREAM_KILLED, store_url, str(d)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == -9, out.stderr
    store = open_store(store_url)
    assert store.images("job-k", whole_only=False) == [] and store.newest("job-k") is None
    assert store.discard_partial("job-k", "killed") >= 1  # a temporary file, or an unfinished multipart upload
    assert store.discard_partial("job-k", "killed") == 0
    if store_url.startswith("file://"):
        assert not [p for p in Path(store_url[7:]).rglob("*") if p.is_file()]


def test_prune_keeps_the_newest_whole_images_and_an_upload_under_way(store_url: str, sealed: Path,
                                                                     tmp_path: Path) -> None:
    store = open_store(store_url)
    for name in ("20260101T000001.000000Z", "20260101T000002.000000Z", "20260101T000004.000000Z"):
        store.push(str(sealed), "job-p", name=name)
    # an upload that died between two whole ones, and one under way after the newest
    for name in ("20260101T000003.000000Z", "20260101T000005.000000Z"):
        store._put(f"job-p/images/{name}/pages-1.img", b"half")
    out = snapguard("prune", "--store", store_url, "--job", "job-p", "--keep", "2", "--json", env=node_env(tmp_path))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["deleted"] == ["20260101T000001.000000Z", "20260101T000003.000000Z"]
    assert [(r.name, r.complete) for r in store.images("job-p", whole_only=False)] == [
        ("20260101T000002.000000Z", True), ("20260101T000004.000000Z", True), ("20260101T000005.000000Z", False)]
    assert store.pull(store.newest("job-p"), str(tmp_path / "dest")).bytes > 0  # what is kept is whole
    bad = snapguard("prune", "--store", store_url, "--job", "job-p", "--keep", "0", env=node_env(tmp_path))
    assert bad.returncode == 2 and bad.stderr.startswith("snapguard USAGE_ERROR: "), bad.stderr  # nothing tried


def test_restore_from_on_the_other_node(rgw_nodes, rgw, sealed: Path, tmp_path: Path) -> None:
    """Node a snapshots a counter (stop) and pushes it; node b, a network namespace of its own
    reaching the store over its veth, restores it with --from; the counter continues exactly.
    A late push from node a afterwards is FENCED; racing restores of the image: one wins."""
    import boto3


    bucket = f"sg-{uuid.uuid4().hex[:12]}"
    boto3.session.Session().client("s3", endpoint_url=rgw.endpoint).create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/snaps"
    over_veth = {"S3_ENDPOINT_URL": f"http://{rgw_nodes.host_address}:{rgw.port}",
                 "AWS_ENDPOINT_URL_S3": f"http://{rgw_nodes.host_address}:{rgw.port}"}
    env_a, env_b = {**node_env(tmp_path / "a"), **over_veth}, {**node_env(tmp_path / "b"), **over_veth}
    log = tmp_path / "counter.log"
    proc = subprocess.Popen([sys.executable, "-c", COUNTER, str(log)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=rgw_nodes.enter("a"))
    restored = None
    try:
        wait_lines(log, 5)
        out = snapguard("checkpoint", "--pid", str(proc.pid), "--images", str(tmp_path / "a" / "img"),
                        env=env_a, preexec=rgw_nodes.enter("a"))
        assert out.returncode == 0, out.stderr
        proc.wait(timeout=10)
        last = values(log)[-1][0]
        log.rename(tmp_path / "before.log")
        out = snapguard("push", "--images", str(tmp_path / "a" / "img"), "--store", url, "--job", "train", "--json",
                        env=env_a, preexec=rgw_nodes.enter("a"))
        assert out.returncode == 0, out.stderr
        pushed = json.loads(out.stdout)["image"]
        out = snapguard("restore", "--store", url, "--job", "train", "--images", str(tmp_path / "b" / "img"),
                        "--json", env=env_b, preexec=rgw_nodes.enter("b"))
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        restored = result["pid"]
        assert result["fence_epoch"] == 1 and result["store"] == url
        wait_lines(log, 5)
        first = values(log)[0]
        assert first == (last + 1, expected_hash(last + 1))  # exactly where node a stopped it
        assert all(b == (a[0] + 1, (a[1] * 31 + a[0] + 1) % MODULUS) for a, b in zip(values(log), values(log)[1:]))
        with open(f"/proc/{restored}/ns/net") as _:
            assert os.readlink(f"/proc/{restored}/ns/net") != os.readlink("/proc/self/ns/net")
        # node a, late, pushes another snapshot under its old epoch: refused, nothing written
        store = open_store(url, endpoint_url=rgw.endpoint)
        before = store._list("")
        late = snapguard("push", "--images", str(sealed), "--store", url, "--job", "train", env=env_a,
                         preexec=rgw_nodes.enter("a"))
        assert late.returncode == 1 and late.stderr.startswith("snapguard FENCED: "), late.stderr
        assert store._list("") == before
        # node b's own later snapshots carry its epoch (from its restore): accepted
        ok = snapguard("push", "--images", str(sealed), "--store", url, "--job", "train", env=env_b,
                       preexec=rgw_nodes.enter("b"))
        assert ok.returncode == 0, ok.stderr
        # two more restores of the image node b was restored from: both ALREADY_RESTORED, before
        # anything is fetched or started, and no epoch is taken
        racers = [subprocess.Popen([SNAPGUARD, "restore", "--store", url, "--job", "train", "--image", pushed, "--json"],
                                   env={**os.environ, **(env_a if n == "a" else env_b)}, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=rgw_nodes.enter(n))
                   for n in ("a", "b")]
        outs = [r.communicate(timeout=120) for r in racers]
        for stdout, _ in outs:  # never expected: a racer that restored a second copy is ended
            if stdout.strip().startswith("{") and json.loads(stdout).get("ok"):
                subprocess.run(["kill", "-9", str(json.loads(stdout)["pid"])], check=False)
        lines = sorted((err.splitlines() or ["(none)"])[0].split(":")[0] for _, err in outs)
        assert lines == ["snapguard ALREADY_RESTORED", "snapguard ALREADY_RESTORED"], lines
        assert store.current_epoch("train") == 1
    finally:
        proc.kill()
        if restored:
            subprocess.run(["kill", "-9", str(restored)], check=False)


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A tmpfs of 3 spans (a full file system within reach), unmounted after the test."""
    mnt = tmp_path / "small"
    mnt.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={3 * SPAN},mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_pull_of_a_file_of_several_spans_and_into_a_full_file_system(tmp_path: Path, sealed: Path,
                                                                     small_tmpfs: Path) -> None:
    """A file of several spans is pulled through a shared mapping of the copy (threads do not take
    turns on its inode lock): bytes and digests as sealed; a copy that cannot fit is refused before
    a byte is stored, and a page the file system cannot give mid-copy fails the pull (EIO), not the
    process (SIGBUS)."""
    img = tmp_path / "img"
    shutil.copytree(sealed, img)
    block = os.urandom(1 << 20)
    (img / "pages-1.img").write_bytes(block * (2 * (SPAN >> 20)) + os.urandom(5))  # 2 spans + 5 bytes
    fields = {k: v for k, v in image.verify(str(sealed)).to_json().items() if k not in ("files", "image_bytes")}
    image.seal(str(img), fields)
    store = open_store(f"file://{tmp_path}/store")
    ref = store.push(str(img), "job1")
    pulled = store.pull(ref, str(tmp_path / "dest"), durable=False)
    assert (Path(pulled.image_dir) / "pages-1.img").read_bytes() == (img / "pages-1.img").read_bytes()
    assert pulled.digests == {n: e["sha256"] for n, e in pulled.manifest["files"].items()}
    # a file system with less room than the file: ENOSPC before anything is stored, nothing left
    (small_tmpfs / "filler").write_bytes(block * (2 * (SPAN >> 20)))  # leaves one span free
    with pytest.raises(OSError) as e:
        store.pull(ref, str(small_tmpfs / "dest"), durable=False)
    assert e.value.errno == errno.ENOSPC and not (small_tmpfs / "dest").exists()
    # room at the check, gone during the copy: another writer fills the file system meanwhile.
    # It leaves the copy 8 MiB of room beyond the file before the pull (so the check passes), and
    # takes those 8 MiB once the copy exists: a race of 8 MiB against the copy's 128 MiB, which it
    # wins, where filling all of the room once the copy existed could lose to a fast copy
    (small_tmpfs / "filler").unlink()
    room = os.statvfs(small_tmpfs)
    spare = room.f_bavail * room.f_frsize - (img / "pages-1.img").stat().st_size - (8 << 20)
    (small_tmpfs / "filler").write_bytes(block * (spare >> 20))
    stop = threading.Event()

    def fill() -> None:
        while not stop.is_set():  # as soon as the copy exists, take what it has not yet stored
            if any((small_tmpfs / "dest2").glob("pages-1.img")):
                try:
                    with open(small_tmpfs / "filler2", "wb") as f:
                        while True:
                            f.write(block)
                except OSError:
                    return
            time.sleep(0.0005)

    filler = threading.Thread(target=fill)
    filler.start()
    try:
        with pytest.raises(OSError) as e:
            store.pull(ref, str(small_tmpfs / "dest2"), durable=False)
    finally:
        stop.set()
        filler.join()
    assert e.value.errno in (errno.EIO, errno.ENOSPC) and not (small_tmpfs / "dest2").exists()
