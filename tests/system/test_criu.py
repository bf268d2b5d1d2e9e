import os
from pathlib import Path

from snapguard import criu

LOG = """(00.000100) Version: 4.2.1 (gitid 0)
(00.001000) Error (criu/util.c:633): rlimit: Can't setup RLIMIT_NOFILE for self
(00.002000) Dumping path for 3 fd via self 11 [/dev/nvidia0]
(00.002100) fd 3 is chr 195:0
(00.002200) Error (criu/files-ext.c:96): Can't dump file 3 of that type [20660] (chr 195:0)
(00.003000) Error (criu/cr-dump.c:1766): Dumping FAILED.
"""


def test_extract_errors_skips_benign_and_keeps_context() -> None:
    errors = criu.extract_errors(LOG)
    assert [e.where for e in errors] == ["criu/files-ext.c:96", "criu/cr-dump.c:1766"]
    assert "chr 195:0" in errors[0].message
    assert errors[0].context[-1].endswith("fd 3 is chr 195:0")
    assert str(errors[1]) == "Error (criu/cr-dump.c:1766): Dumping FAILED."


def test_real_criu_version_and_check(tmp_path: Path) -> None:
    assert criu.version("/usr/local/sbin/criu") >= criu.MIN_VERSION
    passed, out = criu.check("/usr/local/sbin/criu", str(tmp_path))
    assert passed, out
    assert (tmp_path / "criu-check.json").exists()
    passed_again, out_again = criu.check("/usr/local/sbin/criu", str(tmp_path))
    assert passed_again and "cached" in out_again


def test_prepare_environment_pins_path(tmp_path: Path) -> None:
    from snapguard.config import load
    cfg = load({"SNAPGUARD_STATE_DIR": str(tmp_path / "state"), "SNAPGUARD_CONFIG": os.devnull})
    env = criu.prepare_environment(cfg, "/usr/local/sbin/criu")
    bin_dir = tmp_path / "state" / "bin"
    assert env["PATH"].split(":")[0] == str(bin_dir)
    assert os.readlink(bin_dir / "criu") == "/usr/local/sbin/criu"
    # NVIDIA's is not installed here: snapguard's own stands in
    assert os.readlink(bin_dir / "cuda-checkpoint").endswith("/snapguard-cuda-checkpoint")
    assert (bin_dir.stat().st_mode & 0o777) == 0o700
    assert Path(env["CRIU_CONFIG_FILE"]).read_text() == f"timeout {cfg.criu_timeout_s}\n"
    assert "LD_PRELOAD" not in env


def test_log_marks_first_of_each_and_end(tmp_path: Path) -> None:
    log = tmp_path / "dump.log"
    log.write_text("(00.000239) Running on vm\n"
                   "(00.010000) cuda_plugin: pausing devices on pid 41\n"
                   "pie: 41: no timestamp on this line\n"
                   "(00.512000) Seized task 41, state 1\n"
                   "(00.600000) cuda_plugin: Checkpointing CUDA devices on pid 41 restore_tid 44\n"
                   "(01.900000) Dumping pages (type: 59 pid: 41)\n"
                   "(03.250000) Dumping pages (type: 59 pid: 42)\n"
                   "(03.400000) Unfreezing tasks into 1\n"
                   "(04.125000) Dumping finished successfully\n")
    assert criu.log_marks(str(log)) == {"cuda_lock": 0.01, "seized": 0.512, "cuda_checkpoint": 0.6,
                                        "dump_pages": 1.9, "unfreeze": 3.4, "dumped": 4.125, "end": 4.125}
    assert criu.log_marks(str(tmp_path / "missing.log")) == {}
