import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from snapguard.config import (DEFAULTS, ENV_OVERRIDES, SWITCH_OVERRIDES, TEXT_OVERRIDES, ConfigError,
                              check_pinned_binary, keys, load)
from snapguard.config import pinned_runc


def test_defaults_with_empty_file(tmp_path: Path) -> None:
    f = tmp_path / "empty.toml"
    f.write_text("")
    cfg = load({"SNAPGUARD_CONFIG": str(f)})
    assert (cfg.runc, cfg.criu, cfg.criu_libdir) == ("/usr/sbin/runc", "/usr/local/sbin/criu", "/usr/local/lib/criu")


def test_file_then_env_override(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('runc = "/usr/sbin/runc"\ncriu = "/opt/criu"\ncriu_timeout_s = 90\n')
    cfg = load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_CRIU": "/usr/local/sbin/criu"})
    assert cfg.criu == "/usr/local/sbin/criu" and cfg.criu_timeout_s == 90 and cfg.source == str(f)


@pytest.mark.parametrize("text, message", [
    ('runc = "runc"\n', "`runc` must be an absolute path"),
    ('bogus = 1\n', "unknown key"),
    ('runc = \n', "not valid TOML"),
    ('criu_timeout_s = "60"\n', "criu_timeout_s"),
    ('criu_timeout_s = true\n', "criu_timeout_s"),
])
def test_invalid_config(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
        load({"SNAPGUARD_CONFIG": str(f)})
    assert e.value.reason == "CONFIG_INVALID" and "\n" not in str(e.value)


@pytest.mark.parametrize("key", sorted(SWITCH_OVERRIDES))
def test_a_switch_is_on_unless_the_file_or_the_environment_says_off(tmp_path: Path, key: str) -> None:
    var = SWITCH_OVERRIDES[key]
    f = tmp_path / "c.toml"
    f.write_text("")
    assert getattr(load({"SNAPGUARD_CONFIG": str(f)}), key) is True
    assert getattr(load({"SNAPGUARD_CONFIG": str(f), var: "0"}), key) is False
    f.write_text(f"{key} = false\n")
    assert getattr(load({"SNAPGUARD_CONFIG": str(f)}), key) is False
    assert getattr(load({"SNAPGUARD_CONFIG": str(f), var: "1"}), key) is True
    for word, on in (("off", False), (" Yes ", True), ("false", False), ("on", True)):
        assert getattr(load({"SNAPGUARD_CONFIG": str(f), var: word}), key) is on
    with pytest.raises(ConfigError, match=f"{var} must be one of 1, true") as e:
        load({"SNAPGUARD_CONFIG": str(f), var: "maybe"})
    assert e.value.reason == "CONFIG_INVALID"
    for text in (f'{key} = "0"\n', f"{key} = 1\n"):
        f.write_text(text)
        with pytest.raises(ConfigError, match=f"`{key}` must be true or false"):
            load({"SNAPGUARD_CONFIG": str(f)})


def test_a_bad_switch_does_not_reach_the_pass_through(tmp_path: Path) -> None:
    """Every runc call containerd makes reads the config for runc's path alone: a switch only the
    guarded verbs use, set wrong, fails those (above), never the container's other verbs."""
    exe = tmp_path / "runc"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'runc = "{exe}"\ncuda_broker = "false"\n')
    env = {"SNAPGUARD_CONFIG": str(cfg), "SNAPGUARD_STATE_DIR": str(tmp_path / "state"),
           "SNAPGUARD_CUDA_BROKER_ON": "2"}
    assert pinned_runc(env) == str(exe)
    with pytest.raises(ConfigError, match="SNAPGUARD_CUDA_BROKER_ON must be one of"):
        load(env)


def test_named_config_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load({"SNAPGUARD_CONFIG": str(tmp_path / "nope.toml")})


def test_pinned_runc_refuses_relative_and_unsafe(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="absolute"):
        pinned_runc({"SNAPGUARD_RUNC": "runc"})
    with pytest.raises(ConfigError) as e:
        pinned_runc({"SNAPGUARD_RUNC": str(tmp_path / "missing")})
    assert e.value.reason == "RUNC_UNUSABLE"
    exe = tmp_path / "fake-runc"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o777)  # refused as writable by others: as root only, tests/system/test_root_config.py
    exe.chmod(0o644)
    assert "not an executable" in (check_pinned_binary(str(exe), "runc") or "")
    exe.chmod(0o755)
    assert check_pinned_binary(str(exe), "runc") is None
    assert pinned_runc({"SNAPGUARD_RUNC": str(exe)}) == str(exe)
    assert stat.S_IMODE(exe.stat().st_mode) == 0o755


def test_runc_path_cache_follows_config_changes(tmp_path: Path) -> None:
    exe_a, exe_b = tmp_path / "runc-a", tmp_path / "runc-b"
    for exe in (exe_a, exe_b):
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'runc = "{exe_a}"\n')
    env = {"SNAPGUARD_CONFIG": str(cfg), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")}
    assert pinned_runc(env) == str(exe_a)
    cache = tmp_path / "state" / "runc-path.cache"
    assert cache.read_text().splitlines()[1] == str(exe_a)
    assert pinned_runc(env) == str(exe_a)  # from the cache
    cfg.write_text(f'runc = "{exe_b}"   \n')  # new size and mtime: parsed again
    assert pinned_runc(env) == str(exe_b)


def test_runc_path_cache_writable_by_others_is_ignored(tmp_path: Path) -> None:
    exe = tmp_path / "runc"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'runc = "{exe}"\n')
    env = {"SNAPGUARD_CONFIG": str(cfg), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")}
    pinned_runc(env)
    cache = tmp_path / "state" / "runc-path.cache"
    stamp = cache.read_text().splitlines()[0]
    cache.write_text(f"{stamp}\n/tmp/evil-runc\n")
    cache.chmod(0o666)
    assert pinned_runc(env) == str(exe)


REPO = Path(__file__).resolve().parents[2]


def test_the_debian_template_is_the_key_tables_rendering() -> None:
    """packaging/debian/config.toml is generated: `python -m snapguard.config template` rewrites it."""
    committed = (REPO / "packaging" / "debian" / "config.toml").read_text()
    assert committed == keys.render_template(), "stale: python -m snapguard.config template > packaging/debian/config.toml"
    assert tomllib.loads(committed) == {}  # every key commented out: the defaults
    for key in keys.KEYS:
        assert f"# {key.comment}\n# {key.name} = " in committed


def test_the_loader_reads_the_key_table(tmp_path: Path) -> None:
    assert DEFAULTS == {key.name: key.default for key in keys.KEYS}
    assert {**ENV_OVERRIDES, **SWITCH_OVERRIDES, **TEXT_OVERRIDES} == {
        key.name: key.env for key in keys.KEYS if key.env}
    assert all(env.startswith("SNAPGUARD_") for env in (key.env for key in keys.KEYS) if env)
    f = tmp_path / "c.toml"
    f.write_text("")
    cfg = load({"SNAPGUARD_CONFIG": str(f)})
    assert {key.name: getattr(cfg, key.name) for key in keys.KEYS if key.kind != "path"} == \
        {key.name: key.default for key in keys.KEYS if key.kind != "path"}
    for key in keys.KEYS:
        if key.kind == "int":
            f.write_text(f"{key.name} = {key.high + 1}\n")
            with pytest.raises(ConfigError, match=f"`{key.name}` must be an integer from 1 to {key.high}"):
                load({"SNAPGUARD_CONFIG": str(f)})


def test_the_config_reference_lists_every_key() -> None:
    text = keys.render_markdown()
    for key in keys.KEYS:
        assert f"| `{key.name}` |" in text and f"## `{key.name}`" in text and key.description in text
    out = subprocess.run([sys.executable, "-m", "snapguard.config", "markdown"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout == text and out.stderr == ""
