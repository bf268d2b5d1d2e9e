"""Hostile contents written into a real store (file:// and a real radosgw): store records, markers
and file-checkpoint records that are not objects, of the wrong shape, nested deep or huge. Each is
refused with STORE_RECORD_INVALID, never in the way of the newest good image or of an older good
file checkpoint; and a store that answers every put as done while keeping nothing (a proxy in
front of the real radosgw) never gets an image marked whole."""

from __future__ import annotations

import hashlib
import os
import socket
import uuid
from pathlib import Path

import pytest

from snapguard import image
from snapguard.names import MARKER_NAME
from snapguard.procfs import host_facts
from snapguard.reasons import Reason, SnapguardError
from snapguard.store import STORE_RECORD, open_store
from snapguard_lab.s3proxy import S3Proxy

pytest_plugins = ("snapguard_lab.s3",)  # rgw: one real radosgw for the session

HOSTILE = {
    "a list": b"[1, 2, 3]",
    "wrong types": b'{"epoch": "7", "location": 42, "manifest_sha256": true}',
    "nested deep": b'{"epoch": 1, "location": "x", "manifest_sha256": ' + b"[" * 3000 + b"]" * 3000 + b"}",
    "huge": b'{"epoch": 1, "location": "' + b"a" * (1 << 20) + b'"}',
}


def new_bucket(gw: object) -> str:
    import boto3

    bucket = f"sg-{uuid.uuid4().hex[:12]}"
    boto3.session.Session().client("s3", endpoint_url=gw.endpoint).create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
    return bucket


@pytest.fixture(params=["file", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    return f"s3://{new_bucket(request.getfixturevalue('rgw'))}/snaps"


@pytest.fixture(scope="module")
def sealed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("sealed") / "img"
    d.mkdir(mode=0o700)
    (d / "pages-1.img").write_bytes(os.urandom(300_000))
    (d / "core-1.img").write_bytes(b"core")
    image.seal(str(d), {"container_id": "c", "criu_version": "4.2.1", "host": host_facts(), "processes": []})
    return d


def overwrite(store: object, key: str, data: bytes) -> None:
    store._put(key, data)  # type: ignore[attr-defined]  # what anyone with write access to the store can do


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_a_bad_store_record_never_blocks_the_newest_good_image(store_url: str, sealed: Path, tmp_path: Path,
                                                                what: str) -> None:
    store = open_store(store_url)
    old = store.push(str(sealed), "job1")
    new = store.push(str(sealed), "job1")
    # a bad record on the OLD image: listing, newest and the pull of the newest go on
    overwrite(store, f"job1/images/{old.name}/{STORE_RECORD}", HOSTILE[what])
    assert store.newest("job1").name == new.name
    listed = {r.name: r for r in store.images("job1", whole_only=False)}
    assert listed[old.name].complete is False and "STORE_RECORD_INVALID" in (listed[old.name].invalid or "")
    store.pull(store.newest("job1"), str(tmp_path / "pulled"))
    # a bad record on the NEWEST image: it does not count; the older good one is the newest
    store = open_store(store_url)
    overwrite(store, f"job1/images/{old.name}/{STORE_RECORD}",
              b'{"epoch": 0, "job": "job1", "name": "%s"}' % old.name.encode())
    overwrite(store, f"job1/images/{new.name}/{STORE_RECORD}", HOSTILE[what])
    assert store.newest("job1").name == old.name
    with pytest.raises(SnapguardError) as e:
        store.pull(new, str(tmp_path / "refused"))
    assert e.value.reason is Reason.STORE_RECORD_INVALID and "\n" not in str(e.value)
    assert not (tmp_path / "refused").exists() or not os.listdir(tmp_path / "refused")


@pytest.mark.parametrize("what", ["a list", "nested deep", "wrong types"])
def test_a_bad_marker_on_the_newest_image_falls_back_to_the_older_one(store_url: str, sealed: Path,
                                                                     tmp_path: Path, what: str) -> None:
    store = open_store(store_url)
    old = store.push(str(sealed), "job1")
    new = store.push(str(sealed), "job1")
    overwrite(store, f"job1/images/{new.name}/{MARKER_NAME}", HOSTILE[what][:4000])
    assert store.newest("job1").name == old.name
    with pytest.raises(SnapguardError) as e:
        store.pull(new, str(tmp_path / "refused"))
    assert e.value.reason is Reason.STORE_RECORD_INVALID


def test_bad_file_checkpoint_records_never_lose_the_older_good_one(store_url: str) -> None:
    store = open_store(store_url)
    store.register_file_checkpoint("job1", "s3://ckpt/job1/step-1000")
    for i, what in enumerate(sorted(HOSTILE)):  # newer than the good one (names sort by time)
        overwrite(store, f"job1/file-checkpoints/29991231T000000.{i:06d}Z.json", HOSTILE[what])
    assert store.newest_file_checkpoint("job1") == "s3://ckpt/job1/step-1000"


class ForgetfulProxy(S3Proxy):
    """In front of the real radosgw: forwards every request as it came (its signature intact),
    except a PUT of an image's page file, which it answers 200 with the body's MD5 as ETag and
    drops: a store that says yes and keeps nothing."""

    def __init__(self, upstream_port: int) -> None:
        self.dropped: list[str] = []
        super().__init__(upstream_port)

    def intercept(self, method: str, target: str, body: bytes, conn: socket.socket) -> bool:
        if method == "PUT" and "/pages-" in target and "uploadId" not in target:
            self.dropped.append(target)
            etag = hashlib.md5(body).hexdigest()
            conn.sendall(f'HTTP/1.1 200 OK\r\nETag: "{etag}"\r\nContent-Length: 0\r\n\r\n'.encode())
            return True
        return False


def test_a_store_that_says_yes_and_keeps_nothing_never_gets_a_marker(rgw, sealed: Path) -> None:
    from snapguard.store._s3 import S3Store

    bucket = new_bucket(rgw)
    proxy = ForgetfulProxy(rgw.port)  # type: ignore[attr-defined]
    store = S3Store(f"s3://{bucket}/snaps", bucket, "snaps", endpoint_url=f"http://127.0.0.1:{proxy.port}",
                    exchange_s=10)
    with pytest.raises(SnapguardError) as e:
        store.push(str(sealed), "job1")
    assert e.value.reason is Reason.STORE_WRITE_UNCONFIRMED and "pages-1.img" in str(e.value)
    assert proxy.dropped, "the proxy dropped no put: the test proved nothing"
    direct = open_store(f"s3://{bucket}/snaps")
    assert direct.images("job1", whole_only=False) == [] and direct.newest("job1") is None
