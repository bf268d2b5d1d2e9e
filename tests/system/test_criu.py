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


def test_run_directory_pins_path_per_run(tmp_path: Path) -> None:
    from snapguard.config import load, resolve_cuda_checkpoint

    cfg = load({"SNAPGUARD_STATE_DIR": str(tmp_path / "state"), "SNAPGUARD_CONFIG": str(_empty(tmp_path))})
    options = criu.CriuOptions(images_dir=str(tmp_path), work_dir=str(tmp_path), libdir=cfg.criu_libdir,
                               timeout_s=cfg.criu_timeout_s, network_lock="skip")
    with criu.RunDir(cfg.state_dir, "/usr/local/sbin/criu", resolve_cuda_checkpoint(cfg)) as one, \
            criu.RunDir(cfg.state_dir, "/usr/local/sbin/criu", resolve_cuda_checkpoint(cfg)) as two:
        assert one.path != two.path, "two runs share a directory in the state dir"
        env = one.environment(options, base={"LD_PRELOAD": "/tmp/evil.so", "PATH": "/tmp"})
        bin_dir = Path(one.bin_dir)
        assert env["PATH"].split(":")[0] == str(bin_dir) and "/tmp" not in env["PATH"].split(":")
        assert os.readlink(bin_dir / "criu") == "/usr/local/sbin/criu"
        # NVIDIA's is not installed here: snapguard's own stands in
        assert os.readlink(bin_dir / "cuda-checkpoint").endswith("/snapguard-cuda-checkpoint")
        assert (bin_dir.stat().st_mode & 0o777) == 0o700 and (Path(one.path).stat().st_mode & 0o777) == 0o700
        assert Path(env["CRIU_CONFIG_FILE"]).read_text() == f"timeout {cfg.criu_timeout_s}\nnetwork-lock skip\n"
        assert "LD_PRELOAD" not in env
    assert not os.path.exists(one.path) and not os.path.exists(two.path)


def _empty(tmp_path: Path) -> Path:
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    return cfg


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
