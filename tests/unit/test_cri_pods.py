"""The agent's CRI pod listing and the pod fence, on bad input: a CRI answer that is not protobuf
is one typed line (CRI_UNAVAILABLE), a pod's annotations that do not check skip that pod, and a
bundle whose snapguard.io/epoch cannot be fenced is refused before anything starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from snapguard.notice import _cripods
from snapguard.notice._cripods import CriPods, decode
from snapguard.pipeline._podfence import STORE_ENV, pod_fence
from snapguard.reasons import Reason, SnapguardError


def _field(n: int, body: bytes) -> bytes:
    assert len(body) < 128
    return bytes([n << 3 | 2, len(body)]) + body


def _sandbox(sid: str, handler: str, annotations: dict[str, str]) -> bytes:
    ann = b"".join(_field(6, _field(1, k.encode()) + _field(2, v.encode())) for k, v in annotations.items())
    meta = _field(1, b"trainer-0") + _field(3, b"ml")
    return _field(1, _field(1, sid.encode()) + _field(2, meta) + ann + _field(7, handler.encode()))


def _container(cid: str, sid: str, running: bool = True) -> bytes:
    return _field(1, _field(1, cid.encode()) + _field(2, sid.encode()) + (b"\x30\x01" if running else b"\x30\x02"))


class _Client:
    """What CriPods asks of snapguard.notice._cri.CriClient, answering fixed bytes."""

    answers: dict[str, bytes] = {}

    def __init__(self, socket_path: str) -> None:
        pass

    def call(self, method: str, request: bytes, deadline_s: float, what: str) -> bytes:
        return self.answers[method]

    def close(self) -> None:
        pass


@pytest.fixture
def answers(monkeypatch: pytest.MonkeyPatch) -> dict[str, bytes]:
    from snapguard.notice import _cri

    monkeypatch.setattr(_cri, "CriClient", _Client)
    _Client.answers = {}
    return _Client.answers


def test_opted_in_pods_become_pod_entries_and_bad_ones_are_skipped(answers: dict[str, bytes]) -> None:
    answers["ListPodSandbox"] = (_sandbox("s1", "snapguard", {"snapguard.io/job": "Train.1", "snapguard.io/epoch": "3"})
                                 + _sandbox("s2", "runc", {"snapguard.io/job": "other"})
                                 + _sandbox("s3", "snapguard", {"snapguard.io/job": "bad job"})
                                 + _sandbox("s4", "snapguard", {"app": "web"}))
    answers["ListContainers"] = (_container("c1", "s1") + _container("c1x", "s1", running=False)
                                 + _container("c2", "s2") + _container("c3", "s3") + _container("c4", "s4"))
    entries, skipped = CriPods("/run/c.sock", "http://reg:5000").opted_in()
    assert [(e["container"], e["job"], e["epoch"], e["repository"], e["pod"]) for e in entries] == [
        ("c1", "Train.1", 3, "snapguard/ckpt/train-1", "ml/trainer-0")]
    assert len(skipped) == 1 and "c3" in skipped[0] and "not a job name" in skipped[0]


@pytest.mark.parametrize("garbage", [b"\x0a\xff", b"\x0f", b"\x0a\x05ab"])
def test_a_list_answer_that_is_not_protobuf_is_typed(answers: dict[str, bytes], garbage: bytes) -> None:
    answers["ListPodSandbox"], answers["ListContainers"] = garbage, b""
    with pytest.raises(SnapguardError) as refused:
        CriPods("/run/c.sock", "http://reg:5000").opted_in()
    assert refused.value.reason is Reason.CRI_UNAVAILABLE and "\n" not in str(refused.value)


def test_decode_refuses_truncated_input() -> None:
    assert decode(_cripods.list_containers_request()) == {1: [b"\x12\x02\x08\x01"]}
    for bad in (b"\x08", b"\x0a\x03ab", b"\x0b"):
        with pytest.raises(ValueError):
            decode(bad)


def _bundle(tmp_path: Path, annotations: Any) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"ociVersion": "1.2.0", "annotations": annotations}))
    return str(tmp_path)


def test_pod_fence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STORE_ENV, raising=False)
    assert pod_fence(_bundle(tmp_path, {"snapguard.io/job": "j"})) is None  # no epoch: unfenced, as before
    assert pod_fence(str(tmp_path / "missing")) is None  # runc says what is wrong with its bundle
    with pytest.raises(SnapguardError) as unfenceable:
        pod_fence(_bundle(tmp_path, {"snapguard.io/job": "j", "snapguard.io/epoch": "2"}))
    assert unfenceable.value.reason is Reason.USAGE_ERROR and STORE_ENV in str(unfenceable.value)
    monkeypatch.setenv(STORE_ENV, "file:///srv/store")
    fence = pod_fence(_bundle(tmp_path, {"snapguard.io/job": "j", "snapguard.io/epoch": "2"}))
    assert fence is not None and (fence.job, fence.epoch, fence.store_url) == ("j", 2, "file:///srv/store")
    for bad in ({"snapguard.io/epoch": "2"}, {"snapguard.io/job": "j", "snapguard.io/epoch": "0"},
                {"snapguard.io/job": "j", "snapguard.io/epoch": "-1"}, {"snapguard.io/job": "../x", "snapguard.io/epoch": "1"}):
        with pytest.raises(SnapguardError) as refused:
            pod_fence(_bundle(tmp_path, bad))
        assert refused.value.reason is Reason.USAGE_ERROR, bad
