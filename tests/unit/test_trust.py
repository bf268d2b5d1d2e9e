"""snapguard.trust and the config's use of it: what runs, loads or is written as root must be
controlled by root alone, every directory on the way included.

Hostile trees are built under tmp_path (root-owned 0700 below /tmp, which is root's sticky 1777) by
chowning parts of them to nobody; those tests need root and are skipped without it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapguard import config as config_mod
from snapguard.config import ConfigError, check_pinned_binary, load, pinned_runc, resolve_cuda_checkpoint
from snapguard.files import ensure_private_dir
from snapguard.trust import (
    UntrustedPathError,
    check_trusted_libdir,
    make_private_dir,
    open_trusted,
    private_tempdir,
    resolve_trusted,
)

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="building a hostile tree needs chown, so root")


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    """tmp_path as the kernel names it (what resolve_trusted returns)."""
    return Path(os.path.realpath(tmp_path))


def make_exe(path: Path, mode: int = 0o755) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(mode)
    return path


def nobody_dir(path: Path, mode: int = 0o755) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, NOBODY, NOBODY)
    path.chmod(mode)
    return path


def why(path: str | Path, kind: str = "exec") -> str:
    with pytest.raises(UntrustedPathError) as e:
        resolve_trusted(str(path), kind)
    assert "\n" not in str(e.value) and str(e.value) == f"{path}: {e.value.why}"
    return e.value.why


# --- the walk ---------------------------------------------------------------------------------


@needs_root
def test_nobody_owned_directory_on_the_way(tmp: Path) -> None:
    d = nobody_dir(tmp / "x")
    criu = make_exe(d / "criu")  # root-owned itself: nobody can still rename it away and plant theirs
    assert why(criu) == f"directory {d} is owned by uid {NOBODY}, not root"
    assert check_pinned_binary(str(criu), "criu") is not None


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


@needs_root
def test_nobody_owned_final_file(tmp: Path) -> None:
    exe = make_exe(tmp / "bin" / "runc")
    os.chown(exe, NOBODY, NOBODY)
    assert why(exe) == f"file {exe} is owned by uid {NOBODY}, not root"


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


@needs_root
def test_symlink_in_nobody_dir_to_root_binary_is_refused(tmp: Path) -> None:
    real = make_exe(tmp / "bin" / "runc")
    evil = nobody_dir(tmp / "evil")
    (evil / "runc").symlink_to(real)  # nobody can flip this link between check and exec
    assert why(evil / "runc") == f"directory {evil} is owned by uid {NOBODY}, not root"


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


@needs_root
def test_sticky_directory_takes_only_root_owned_entries(tmp: Path) -> None:
    sticky = tmp / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    mine = make_exe(sticky / "root-dir" / "criu")
    assert resolve_trusted(str(mine), "exec") == str(mine)
    theirs = nobody_dir(sticky / "nobody-dir")
    make_exe(theirs / "criu")
    assert why(theirs / "criu") == f"{theirs} is owned by uid {NOBODY} in sticky directory {sticky}"
    # a symlink in a sticky directory: its owner (who could remove and replace it) must be root
    (sticky / "link").symlink_to(mine)
    assert resolve_trusted(str(sticky / "link"), "exec") == str(mine)
    os.chown(sticky / "link", NOBODY, NOBODY, follow_symlinks=False)
    assert why(sticky / "link") == f"{sticky / 'link'} is owned by uid {NOBODY} in sticky directory {sticky}"
    # the sticky exception is root's only, and a sticky directory is no final directory
    assert why(sticky, "dir") == f"directory {sticky} is writable by group and others"
    os.chown(sticky, NOBODY, NOBODY)
    sticky.chmod(0o1777)  # chown clears nothing on a directory, but be explicit
    assert why(mine) == f"directory {sticky} is owned by uid {NOBODY}, not root"


# --- CRIU's libdir ----------------------------------------------------------------------------


@needs_root
def test_libdir_with_a_nobody_owned_plugin_is_refused(tmp: Path) -> None:
    libdir = tmp / "lib" / "criu"
    libdir.mkdir(parents=True)
    evil = libdir / "evil.so"
    evil.write_bytes(b"\x7fELF")
    os.chown(evil, NOBODY, NOBODY)
    with pytest.raises(UntrustedPathError) as e:
        check_trusted_libdir(str(libdir))
    assert e.value.why == f"plugin {evil} is owned by uid {NOBODY}, not root"


@needs_root
def test_libdir_with_root_plugins_is_accepted(tmp: Path) -> None:
    libdir = tmp / "lib" / "criu"
    libdir.mkdir(parents=True)
    plugin = libdir / "cuda_plugin.so"
    plugin.write_bytes(b"\x7fELF")
    plugin.chmod(0o644)
    notes = libdir / "README"  # CRIU loads *.so only
    notes.write_text("")
    os.chown(notes, NOBODY, NOBODY)
    (tmp / "liblink").symlink_to("lib/criu")
    assert check_trusted_libdir(str(tmp / "liblink")) == str(libdir)
    plugin.chmod(0o664)
    with pytest.raises(UntrustedPathError) as e:
        check_trusted_libdir(str(libdir))
    assert e.value.why == f"plugin {plugin} is writable by group"
    plugin.chmod(0o644)
    # a plugin that is a symlink: its target is checked like any file
    elsewhere = nobody_dir(tmp / "elsewhere")
    (elsewhere / "x.so").write_bytes(b"\x7fELF")
    (libdir / "y.so").symlink_to(elsewhere / "x.so")
    with pytest.raises(UntrustedPathError) as e:
        check_trusted_libdir(str(libdir))
    assert e.value.path == str(libdir / "y.so")
    assert e.value.why.endswith(f"directory {elsewhere} is owned by uid {NOBODY}, not root")


# --- private directories ----------------------------------------------------------------------


@pytest.fixture
def umask_000() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("umask", [0o000, 0o777])
def test_make_private_dir_whatever_the_umask(tmp: Path, umask: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under umask 000 mkdir's 0700 stays 0700, under 077x it would be 0000: fchmod decides."""
    old = os.umask(umask)
    try:
        _private_dirs(tmp, monkeypatch)
    finally:
        os.umask(old)


def _private_dirs(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp / "state" / "run" / "snap"
    assert make_private_dir(str(target)) == str(target)
    for d in (tmp / "state", tmp / "state" / "run", target):
        st = d.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid(), d
    existing = tmp / "existing"
    existing.mkdir(mode=0o755)
    assert make_private_dir(str(existing)) == str(existing)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o700
    # the files.py entry point callers use, relative paths taken from the cwd
    monkeypatch.chdir(tmp)
    assert ensure_private_dir("images/a") == str(tmp / "images" / "a")
    assert stat.S_IMODE((tmp / "images").stat().st_mode) == 0o700


def test_make_private_dir_refuses_a_symlink(tmp: Path) -> None:
    real = tmp / "real"
    real.mkdir(mode=0o700)
    (tmp / "link").symlink_to(real)
    with pytest.raises(UntrustedPathError) as e:
        make_private_dir(str(tmp / "link"))
    assert e.value.why == f"{tmp / 'link'} is a symbolic link"
    # a symlink on the way (not final) in a trusted directory is followed
    assert make_private_dir(str(tmp / "link" / "sub")) == str(real / "sub")


@needs_root
def test_make_private_dir_refuses_others_directories(tmp: Path) -> None:
    theirs = nobody_dir(tmp / "theirs", 0o700)
    with pytest.raises(UntrustedPathError) as e:
        make_private_dir(str(theirs))
    assert e.value.why == f"directory {theirs} is owned by uid {NOBODY}, not root"
    with pytest.raises(UntrustedPathError) as e:
        make_private_dir(str(theirs / "images"))
    assert e.value.why == f"directory {theirs} is owned by uid {NOBODY}, not root"
    assert not (theirs / "images").exists()
    shared = tmp / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # root's, but others may have planted files in it already
    with pytest.raises(UntrustedPathError) as e:
        make_private_dir(str(shared))
    assert e.value.why == f"directory {shared} is writable by group and others"
    assert stat.S_IMODE(shared.stat().st_mode) == 0o777  # refused, not silently tightened


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


@needs_root
def test_nobody_owned_config_is_untrusted(tmp: Path) -> None:
    f = tmp / "c.toml"
    f.write_text("")
    os.chown(f, NOBODY, NOBODY)
    env = {"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_STATE_DIR": str(tmp / "state")}
    for call in (load, pinned_runc):
        with pytest.raises(ConfigError) as e:
            call(env)
        assert e.value.reason == "UNTRUSTED_PATH"
        assert str(e.value) == f"config file {f}: file {f} is owned by uid {NOBODY}, not root"
    # a root-owned config in a directory nobody controls chooses the binaries just the same
    d = nobody_dir(tmp / "etc")
    g = d / "c.toml"
    g.write_text("")
    with pytest.raises(ConfigError) as e:
        load({"SNAPGUARD_CONFIG": str(g)})
    assert e.value.reason == "UNTRUSTED_PATH" and f"directory {d} is owned by uid {NOBODY}" in str(e.value)


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


@needs_root
@pytest.mark.parametrize("key, var", [("runc", "SNAPGUARD_RUNC"), ("criu", "SNAPGUARD_CRIU"),
                                      ("cuda_checkpoint", "SNAPGUARD_CUDA_CHECKPOINT")])
def test_load_refuses_an_untrusted_binary(tmp: Path, key: str, var: str) -> None:
    exe = make_exe(nobody_dir(tmp / "opt") / "tool")
    f = tmp / "c.toml"
    f.write_text("")
    with pytest.raises(ConfigError) as e:
        load({"SNAPGUARD_CONFIG": str(f), var: str(exe)})
    assert e.value.reason == "UNTRUSTED_PATH"
    assert str(e.value) == f"`{key}` {exe}: directory {tmp / 'opt'} is owned by uid {NOBODY}, not root"


@needs_root
def test_load_refuses_a_libdir_with_a_nobody_plugin_and_a_nobody_state_dir(tmp: Path) -> None:
    f = tmp / "c.toml"
    f.write_text("")
    libdir = tmp / "criu-lib"
    libdir.mkdir()
    (libdir / "evil.so").write_bytes(b"")
    os.chown(libdir / "evil.so", NOBODY, NOBODY)
    with pytest.raises(ConfigError) as e:
        load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_CRIU_LIBDIR": str(libdir)})
    assert e.value.reason == "UNTRUSTED_PATH" and f"plugin {libdir / 'evil.so'} is owned by uid" in str(e.value)
    # an odd plugin before it ("a.so" a directory) must not end the check early
    (libdir / "a.so").mkdir()
    with pytest.raises(ConfigError) as e:
        load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_CRIU_LIBDIR": str(libdir)})
    assert str(e.value) == f"`criu_libdir` {libdir / 'a.so'}: plugin {libdir / 'a.so'} is not a regular file"
    os.rmdir(libdir / "a.so")
    os.unlink(libdir / "evil.so")
    assert load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_CRIU_LIBDIR": str(libdir)}).criu_libdir == str(libdir)
    missing = tmp / "no-libdir"
    assert load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_CRIU_LIBDIR": str(missing)}).criu_libdir == str(missing)
    state = nobody_dir(tmp / "state", 0o700)
    with pytest.raises(ConfigError) as e:
        load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_STATE_DIR": str(state)})
    assert e.value.reason == "UNTRUSTED_PATH" and str(e.value).startswith("`state_dir`")
    cfg = load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_STATE_DIR": str(tmp / "new-state")})
    assert cfg.state_dir == str(tmp / "new-state")  # missing is fine: created 0700 when needed


@needs_root
def test_pinned_runc_refuses_a_nobody_runc_and_ignores_a_planted_cache(tmp: Path) -> None:
    runc = make_exe(tmp / "bin" / "runc")
    f = tmp / "c.toml"
    f.write_text(f'runc = "{runc}"\n')
    state = tmp / "state"
    env = {"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_STATE_DIR": str(state)}
    assert pinned_runc(env) == str(runc)
    cache = state / config_mod.RUNC_CACHE
    stamp = cache.read_text().splitlines()[0]
    evil = make_exe(tmp / "evil-runc")
    cache.write_text(f"{stamp}\n{evil}\n")
    os.chown(cache, NOBODY, NOBODY)  # 0600 but someone else's: not root's word
    assert pinned_runc(env) == str(runc)
    os.chown(runc, NOBODY, NOBODY)
    with pytest.raises(ConfigError) as e:
        pinned_runc(env)
    assert e.value.reason == "UNTRUSTED_PATH" and str(e.value) == \
        f"runc {runc}: file {runc} is owned by uid {NOBODY}, not root"


@needs_root
def test_cuda_checkpoint_is_returned_only_when_trusted(tmp: Path) -> None:
    f = tmp / "c.toml"
    f.write_text("")
    tool = tmp / "opt" / "cuda-checkpoint"
    cfg = load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_CUDA_CHECKPOINT": str(tool)})
    assert cfg.cuda_checkpoint == str(tool)  # missing at load: kept
    make_exe(tool)
    assert resolve_cuda_checkpoint(cfg) == str(tool)
    os.chown(tool, NOBODY, NOBODY)  # appeared later, someone else's: never handed to CRIU's plugin
    assert resolve_cuda_checkpoint(cfg) != str(tool)
