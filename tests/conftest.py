"""Shared fixtures: a private containerd whose runc is snapguard-runc, and snapguard's config.

containerd passes its environment to the shim and so to snapguard-runc: SNAPGUARD_CONFIG points
at a file the tests rewrite to change what the executor sees (a missing CRIU, say).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapguard_lab.testbed import Containerd

REPO = Path(__file__).resolve().parent.parent


def _installed_script(name: str) -> str:
    path = shutil.which(name, path=os.path.dirname(sys.executable))
    if path is None:
        pytest.fail(f"{name} is not installed next to {sys.executable}: pip install -e .")
    return path


@pytest.fixture(scope="session")
def snapguard_runc() -> str:
    return _installed_script("snapguard-runc")


@pytest.fixture(scope="session")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config") / "config.toml"
    path.write_text("")
    return path


@pytest.fixture
def clean_config(config_file: Path) -> Iterator[Path]:
    """The shared config file, emptied before and after the test (defaults apply)."""
    config_file.write_text("")
    yield config_file
    config_file.write_text("")


@pytest.fixture(scope="session")
def containerd(tmp_path_factory: pytest.TempPathFactory, config_file: Path) -> Iterator[Containerd]:
    if os.geteuid() != 0:
        pytest.fail("the containerd tests need root (CI and the README's test command run as root)")
    ctd = Containerd(str(tmp_path_factory.mktemp("containerd")),
                     env={"SNAPGUARD_CONFIG": str(config_file),
                          "SNAPGUARD_STATE_DIR": str(tmp_path_factory.mktemp("state"))})
    ctd.start()
    try:
        ctd.import_counter_image()
        yield ctd
    finally:
        ctd.stop()
