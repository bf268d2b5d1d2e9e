from snapguard.reasons import Failure, Finding, Phase, Reason, Severity, SnapguardError


def test_every_reason_has_meaning_phase_and_remedy() -> None:
    for reason in Reason:
        assert reason.meaning and reason.remedy, reason
        assert isinstance(reason.phase, Phase)
        assert reason.name.isupper()


def test_reason_values_are_distinct() -> None:
    # Enum aliases would silently merge two reasons with identical metadata.
    assert len({r.name for r in Reason}) == len(Reason.__members__)


def test_failure_message_is_one_self_contained_line() -> None:
    f = Failure(Reason.GPU_MODEL_MISMATCH, "image taken on NVIDIA H100 80GB HBM3,\nthis host has NVIDIA H200")
    assert f.message == ("snapguard GPU_MODEL_MISMATCH: image taken on NVIDIA H100 80GB HBM3, "
                         "this host has NVIDIA H200")
    assert "\n" not in f.message
    d = f.to_dict()
    assert d["reason"] == "GPU_MODEL_MISMATCH" and d["phase"] == "restore" and d["ok"] is False


def test_error_carries_record_and_overrides() -> None:
    e = SnapguardError(Reason.CRIU_DUMP_FAILED, "boom", workload_intact=False, evidence={"pid": 3})
    assert str(e) == "snapguard CRIU_DUMP_FAILED: boom"
    assert e.failure.workload_intact is False and e.failure.evidence == {"pid": 3}
    warn = Finding(Reason.KERNEL_CHANGED, "differs", Severity.WARNING)
    e2 = SnapguardError.from_finding(Finding(Reason.IO_URING_PRESENT, "pid 1"), [warn])
    assert e2.failure.to_dict()["warnings"][0]["reason"] == "KERNEL_CHANGED"
