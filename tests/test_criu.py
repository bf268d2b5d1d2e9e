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
    from snapguard._config import load
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
