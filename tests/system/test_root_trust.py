"""snapguard.trust and the config's use of it on hostile trees: parts of tmp_path (root-owned 0700
below /tmp, which is root's sticky 1777) chowned to nobody, so these run as root. The walk's other
rules are in tests/unit/test_trust.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from snapguard import config as config_mod
from snapguard.config import ConfigError, check_pinned_binary, load, pinned_runc, resolve_cuda_checkpoint
from snapguard.trust import UntrustedPathError, check_trusted_libdir, make_private_dir, resolve_trusted
from tests.trusted import make_exe, private_dirs_under_umask
from tests.trusted import why_untrusted as why

pytestmark = pytest.mark.root

NOBODY = 65534


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    """tmp_path as the kernel names it (what resolve_trusted returns)."""
    return Path(os.path.realpath(tmp_path))


def nobody_dir(path: Path, mode: int = 0o755) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, NOBODY, NOBODY)
    path.chmod(mode)
    return path


def test_nobody_owned_directory_on_the_way(tmp: Path) -> None:
    d = nobody_dir(tmp / "x")
    criu = make_exe(d / "criu")  # root-owned itself: nobody can still rename it away and plant theirs
    assert why(criu) == f"directory {d} is owned by uid {NOBODY}, not root"
    assert check_pinned_binary(str(criu), "criu") is not None


def test_nobody_owned_final_file(tmp: Path) -> None:
    exe = make_exe(tmp / "bin" / "runc")
    os.chown(exe, NOBODY, NOBODY)
    assert why(exe) == f"file {exe} is owned by uid {NOBODY}, not root"


def test_symlink_in_nobody_dir_to_root_binary_is_refused(tmp: Path) -> None:
    real = make_exe(tmp / "bin" / "runc")
    evil = nobody_dir(tmp / "evil")
    (evil / "runc").symlink_to(real)  # nobody can flip this link between check and exec
    assert why(evil / "runc") == f"directory {evil} is owned by uid {NOBODY}, not root"


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


def test_libdir_with_a_nobody_owned_plugin_is_refused(tmp: Path) -> None:
    libdir = tmp / "lib" / "criu"
    libdir.mkdir(parents=True)
    evil = libdir / "evil.so"
    evil.write_bytes(b"\x7fELF")
    os.chown(evil, NOBODY, NOBODY)
    with pytest.raises(UntrustedPathError) as e:
        check_trusted_libdir(str(libdir))
    assert e.value.why == f"plugin {evil} is owned by uid {NOBODY}, not root"


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


@pytest.mark.parametrize("umask", [0o777])  # mkdir's 0000 directories: only root walks into them
def test_make_private_dir_whatever_the_umask(tmp: Path, umask: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under umask 000 mkdir's 0700 stays 0700, under 077x it would be 0000: fchmod decides."""
    private_dirs_under_umask(tmp, umask, monkeypatch)
