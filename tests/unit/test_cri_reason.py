"""snapguard.notice._crireason: snapguard-runc's reason behind containerd's CheckpointContainer
error, read strictly. The messages are containerd 2.1.9's (its runc shim keeps the first line of
the runtime's output and appends `path= <bundle>/criu-dump.log`); log.json is the runtime's --log
as runc and snapguard-runc write it (JSON lines)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from snapguard.notice._crireason import executor_failure
from snapguard.reasons import Reason

CID = "7f1bb0d6fdc61091d3d264a6a4a47d6498f89d82066b317a10f39f2d52ee083a"


def _now(offset_s: float = 0.0) -> str:
    t = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=offset_s)
    return t.isoformat(timespec="seconds").replace("+00:00", "Z")


def _bundle(tmp_path: Path, lines: list[dict[str, str]], cid: str = CID) -> tuple[Path, str]:
    bundle = tmp_path / "state" / "io.containerd.runtime.v2.task" / "k8s.io" / cid
    bundle.mkdir(parents=True)
    (bundle / "log.json").write_text("".join(json.dumps(x) + "\n" for x in lines))
    message = (f'checkpointing container "{cid}" failed: /usr/bin/snapguard-runc did not terminate successfully: '
               f"exit status 1: criu failed: type DUMP errno 0 path= {bundle}/criu-dump.log")
    return bundle, message


def test_the_reason_in_log_json_when_containerd_kept_runcs_line(tmp_path: Path) -> None:
    _, message = _bundle(tmp_path, [
        {"level": "error", "msg": "criu failed: type DUMP errno 0", "time": _now()},
        {"level": "error", "msg": "snapguard CRIU_DUMP_FAILED: mnt: FS mnt ./usr/local/nvidia unsupported",
         "time": _now()},
        {"level": "info", "msg": "snapguard CRIU_MISSING: an info line is not the reason", "time": _now()}])
    said = executor_failure(message, CID, datetime.datetime.now().timestamp() - 1)
    assert said is not None and said.reason is Reason.CRIU_DUMP_FAILED
    assert said.message == "mnt: FS mnt ./usr/local/nvidia unsupported" and said.source.endswith("/log.json")


def test_the_reason_in_containerds_message_first(tmp_path: Path) -> None:
    message = (f'checkpointing container "{CID}" failed: x did not terminate successfully: exit status 1: '
               f"snapguard CRIU_MISSING: criu /nope: does not exist path= /run/x/io.containerd.runtime.v2.task/"
               f"k8s.io/{CID}/criu-dump.log")
    said = executor_failure(message, CID, 0)
    assert said is not None and said.reason is Reason.CRIU_MISSING and said.message == "criu /nope: does not exist"


def test_nothing_but_a_known_reason_of_this_call_for_this_container(tmp_path: Path) -> None:
    _, unknown = _bundle(tmp_path / "1", [{"level": "error", "msg": "snapguard NOT_A_REASON: x", "time": _now()}])
    assert executor_failure(unknown, CID, 0) is None
    _, old = _bundle(tmp_path / "2", [{"level": "error", "msg": "snapguard CRIU_DUMP_FAILED: x", "time": _now(-60)}])
    assert executor_failure(old, CID, datetime.datetime.now().timestamp()) is None  # an earlier run's
    other = "0" * 64
    _, theirs = _bundle(tmp_path / "3", [{"level": "error", "msg": "snapguard CRIU_DUMP_FAILED: x", "time": _now()}],
                        cid=other)
    assert executor_failure(theirs, CID, 0) is None  # another container's bundle
    bundle, loose = _bundle(tmp_path / "4", [{"level": "error", "msg": "snapguard CRIU_DUMP_FAILED: x",
                                             "time": _now()}])
    (bundle / "log.json").chmod(0o666)
    assert executor_failure(loose, CID, 0) is None  # a file others may write is not the executor's word
    (bundle / "log.json").chmod(0o600)
    assert executor_failure(loose, CID, 0) is not None  # the same line, root's alone
    assert executor_failure("rpc error: no such container", CID, 0) is None
    assert executor_failure("path= /etc/criu-dump.log", CID, 0) is None
