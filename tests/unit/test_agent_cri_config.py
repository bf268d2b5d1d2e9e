"""The agent's CRI path from the config keys cri_socket, registry and registry_repository (the file,
then $SNAPGUARD_CRI_SOCKET, $SNAPGUARD_REGISTRY, $SNAPGUARD_REGISTRY_REPOSITORY), each overridden
by its flag; a bad value is one typed line naming where it came from (CONFIG_INVALID for a key,
USAGE_ERROR for a flag), before anything is watched."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapguard.cli import build_parser
from snapguard.cli.agent import _cri
from snapguard.config import load
from snapguard.reasons import Reason, SnapguardError


def _config(tmp_path: Path, text: str, **env: str):
    f = tmp_path / "config.toml"
    f.write_text(text)
    f.chmod(0o600)
    return load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_STATE_DIR": str(tmp_path / "state"), **env})


def _args(*flags: str):
    return build_parser().parse_args(["agent", "--store", "file:///var/lib/snaps", *flags])


def test_the_config_keys_turn_the_cri_path_on_and_flags_override_them(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 'cri_socket = "/run/containerd/containerd.sock"\nregistry = "https://reg:5000/"\n')
    pods = _cri(_args(), cfg)
    assert (pods.socket, pods.registry_url, pods.repository_prefix) == (
        "/run/containerd/containerd.sock", "https://reg:5000", "snapguard/ckpt")
    pods = _cri(_args("--cri-socket", "/other.sock", "--registry-repository", "team/ckpt"), cfg)
    assert (pods.socket, pods.registry_url, pods.repository_prefix) == ("/other.sock", "https://reg:5000", "team/ckpt")
    env = _config(tmp_path, "", SNAPGUARD_CRI_SOCKET="/env.sock", SNAPGUARD_REGISTRY="http://r:80",
                  SNAPGUARD_REGISTRY_REPOSITORY="x/y")
    pods = _cri(_args(), env)
    assert (pods.socket, pods.registry_url, pods.repository_prefix) == ("/env.sock", "http://r:80", "x/y")
    assert _cri(_args(), _config(tmp_path, "")) is None  # the defaults: off


@pytest.mark.parametrize("text, flags, reason, says", [
    ('cri_socket = "run/c.sock"\nregistry = "http://r"\n', (), Reason.CONFIG_INVALID, "`cri_socket`"),
    ('cri_socket = "/c.sock"\nregistry = "ftp://r"\n', (), Reason.CONFIG_INVALID, "`registry`"),
    ('cri_socket = "/c.sock"\nregistry = "http://r"\nregistry_repository = "Up/Per"\n', (), Reason.CONFIG_INVALID,
     "`registry_repository`"),
    ('cri_socket = "/c.sock"\n', (), Reason.CONFIG_INVALID, "give --registry URL"),
    ('cri_socket = "/c.sock"\nregistry = "http://r"\n', ("--registry", "http://r/path"), Reason.USAGE_ERROR,
     "--registry 'http://r/path'"),
])
def test_a_bad_setting_is_typed_and_names_where_it_came_from(tmp_path: Path, text: str, flags: tuple[str, ...],
                                                               reason: Reason, says: str) -> None:
    with pytest.raises(SnapguardError) as bad:
        _cri(_args(*flags), _config(tmp_path, text))
    assert bad.value.reason is reason and says in str(bad.value) and "\n" not in str(bad.value), bad.value


def test_a_key_that_is_not_a_string_is_a_config_error(tmp_path: Path) -> None:
    from snapguard.config import ConfigError

    with pytest.raises(ConfigError) as bad:
        _config(tmp_path, "registry = 5\n")
    assert "`registry` must be a string" in str(bad.value)
