"""snapguard.trust and the config's use of it: what runs, loads or is written as root must be
controlled by root alone, every directory on the way included.

Hostile trees built by chowning parts of tmp_path to nobody need root: those tests are in
tests/system/test_root_trust.py.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapguard.config import ConfigError, check_pinned_binary, load, pinned_runc
from snapguard.trust import (
    UntrustedPathError,
    make_private_dir,
    open_trusted,
    private_tempdir,
    resolve_trusted,
)
from tests.trusted import make_exe, private_dirs_under_umask
from tests.trusted import why_untrusted as why


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    """tmp_path as the kernel names it (what resolve_trusted returns)."""
    return Path(os.path.realpath(tmp_path))


# --- the walk ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, who", [(0o775, "group"), (0o757, "others"), (0o777, "group and others")])
def test_writable_directory_on_the_way(tmp: Path, mode: int, who: str) -> None:
    d = tmp / "x"
    criu = make_exe(d / "criu")
    d.chmod(mode)
    assert why(criu) == f"directory {d} is writable by {who}"
    if who == "others":  # the form the security review's report uses
        with pytest.raises(UntrustedPathError, match=f"^{criu}: directory {d} is writable by others$"):
            resolve_trusted(str(criu), "exec")


def test_final_object_checks(tmp: Path) -> None:
    exe = make_exe(tmp / "bin" / "tool", 0o775)
    assert why(exe) == f"file {exe} is writable by group"
    exe.chmod(0o644)
    assert why(exe) == f"{exe} is not an executable file"
    assert resolve_trusted(str(exe), "file") == str(exe)
    assert why(tmp / "bin", "file") == f"{tmp / 'bin'} is not a regular file"
    assert why(exe, "dir") == f"{exe} is not a directory"
    assert resolve_trusted(str(tmp / "bin"), "dir") == str(tmp / "bin")


def test_missing_relative_and_nul(tmp: Path) -> None:
    with pytest.raises(UntrustedPathError) as e:
        resolve_trusted(str(tmp / "no" / "criu"), "exec")
    assert e.value.why == "does not exist" and e.value.missing and e.value.errno == errno.ENOENT
    with pytest.raises(UntrustedPathError) as e:
        resolve_trusted("criu", "exec")
    assert e.value.why == "not an absolute path" and not e.value.missing
    assert why(f"{tmp}/a\0b") == "contains a NUL byte"
    make_exe(tmp / "f")
    assert why(tmp / "f" / "g") == f"{tmp / 'f'} is not a directory"


def test_symlink_in_root_dir_is_followed_to_the_canonical_target(tmp: Path) -> None:
    real = make_exe(tmp / "bin" / "runc")
    links = tmp / "links"
    links.mkdir()
    (links / "abs").symlink_to(real)
    (links / "rel").symlink_to("../bin/runc")
    (links / "chain").symlink_to("rel")
    (tmp / "bindir").symlink_to("bin")
    for path in (links / "abs", links / "rel", links / "chain", tmp / "bindir" / "runc",
                 tmp / "bin" / ".." / "bin" / "." / "runc"):
        assert resolve_trusted(str(path), "exec") == str(real)
    # ".." after a symlinked directory goes up from where the link led, as the kernel does
    (tmp / "deep" / "er").mkdir(parents=True)
    (tmp / "up").symlink_to("deep/er")
    make_exe(tmp / "deep" / "runc")
    assert resolve_trusted(str(tmp / "up" / ".." / "runc"), "exec") == str(tmp / "deep" / "runc")
    assert resolve_trusted("/..", "dir") == "/"


def test_symlink_loop_and_the_hop_limit(tmp: Path) -> None:
    (tmp / "a").symlink_to("b")
    (tmp / "b").symlink_to("a")
    with pytest.raises(UntrustedPathError) as e:
        resolve_trusted(str(tmp / "a"), "exec")
    assert e.value.why == "too many levels of symbolic links" and e.value.errno == errno.ELOOP
    # 40 links in a row resolve, as in the kernel; the 41st is one too many
    real = make_exe(tmp / "real")
    (tmp / "l0").symlink_to(real)
    for i in range(1, 41):
        (tmp / f"l{i}").symlink_to(f"l{i - 1}")
    assert resolve_trusted(str(tmp / "l39"), "exec") == str(real)
    assert why(tmp / "l40") == "too many levels of symbolic links"


# --- private directories ----------------------------------------------------------------------


@pytest.fixture
def umask_000() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("umask", [0o000])  # 0o777, where only root can walk in: tests/system
def test_make_private_dir_whatever_the_umask(tmp: Path, umask: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under umask 000 mkdir's 0700 stays 0700, under 077x it would be 0000: fchmod decides."""
    private_dirs_under_umask(tmp, umask, monkeypatch)


def test_make_private_dir_refuses_a_symlink(tmp: Path) -> None:
    real = tmp / "real"
    real.mkdir(mode=0o700)
    (tmp / "link").symlink_to(real)
    with pytest.raises(UntrustedPathError) as e:
        make_private_dir(str(tmp / "link"))
    assert e.value.why == f"{tmp / 'link'} is a symbolic link"
    # a symlink on the way (not final) in a trusted directory is followed
    assert make_private_dir(str(tmp / "link" / "sub")) == str(real / "sub")


def test_make_private_dir_exist_ok_false(tmp: Path) -> None:
    made = make_private_dir(str(tmp / "new"), exist_ok=False)
    with pytest.raises(UntrustedPathError) as e:
        make_private_dir(made, exist_ok=False)
    assert e.value.why == "already exists" and e.value.errno == errno.EEXIST


def test_private_tempdir_gives_each_run_its_own(tmp: Path, umask_000: None) -> None:
    a, b = private_tempdir(str(tmp / "state"), "run-"), private_tempdir(str(tmp / "state"), "run-")
    assert a != b and os.path.dirname(a) == os.path.dirname(b) == str(tmp / "state")
    assert os.path.basename(a).startswith("run-")
    assert stat.S_IMODE(os.stat(a).st_mode) == stat.S_IMODE((tmp / "state").stat().st_mode) == 0o700


# --- open_trusted and the config file ---------------------------------------------------------


def test_open_trusted_reads_the_checked_file(tmp: Path) -> None:
    f = tmp / "c.toml"
    f.write_text("x = 1\n")
    fd = open_trusted(str(f))
    try:
        assert os.get_blocking(fd) and os.read(fd, 100) == b"x = 1\n"
    finally:
        os.close(fd)
    f.chmod(0o646)
    with pytest.raises(UntrustedPathError) as e:
        open_trusted(str(f))
    assert e.value.why == f"file {f} is writable by others"


@pytest.mark.timeout(20)
def test_fifo_as_config_file_does_not_hang(tmp: Path) -> None:
    fifo = tmp / "config.toml"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(UntrustedPathError) as e:
        open_trusted(str(fifo))
    assert e.value.why == f"{fifo} is not a regular file"
    with pytest.raises(ConfigError) as ce:
        load({"SNAPGUARD_CONFIG": str(fifo)})
    assert "is not a regular file" in str(ce.value) and "\n" not in str(ce.value)


@pytest.mark.parametrize("raw", [b'runc = "/usr/sbin/r\xffunc"\n', b"# caf\xe9\n"])
def test_config_with_a_non_utf8_byte_is_one_config_error(tmp: Path, raw: bytes) -> None:
    f = tmp / "c.toml"
    f.write_bytes(raw)
    env = {"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_STATE_DIR": str(tmp / "state")}
    for call in (load, pinned_runc):
        with pytest.raises(ConfigError) as e:
            call(env)
        assert e.value.reason == "CONFIG_INVALID"
        assert str(e.value).startswith(f"{f} is not UTF-8: byte 0x") and "\n" not in str(e.value)


def test_relative_criu_is_refused(tmp: Path) -> None:
    f = tmp / "c.toml"
    f.write_text("")
    with pytest.raises(ConfigError) as e:
        load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_CRIU": "criu"})
    assert str(e.value) == "`criu` must be an absolute path, got 'criu'" and e.value.reason == "CONFIG_INVALID"
    assert check_pinned_binary("criu", "criu") == "criu criu: not an absolute path"


# --- config keys checked at load --------------------------------------------------------------


def test_load_runs_what_it_checked(tmp: Path) -> None:
    real = make_exe(tmp / "bin" / "criu")
    (tmp / "criu-link").symlink_to(real)
    f = tmp / "c.toml"
    f.write_text(f'criu = "{tmp / "criu-link"}"\n')
    cfg = load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_RUNC": str(tmp / "missing-runc")})
    assert cfg.criu == str(real)  # the canonical path, not the link
    assert cfg.runc == str(tmp / "missing-runc")  # missing: preflight reports it, not load


