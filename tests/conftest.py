"""Shared fixtures: a private containerd whose runc is snapguard-runc (snapguard_lab.testbed's one
harness), and snapguard's config; and the markers' rule: a test marked `root` or `stack`
(pyproject.toml) fails without root instead of skipping.

containerd passes its environment to the shim and so to snapguard-runc: SNAPGUARD_CONFIG points
at a file the tests rewrite to change what the executor sees (a missing CRIU, say).

The `containerd` fixture runs on each stack of testbed.STACKS: Debian 12's containerd 1.6 and
runc 1.1 ("debian12"), and Debian unstable's containerd 2.1 and runc 1.3 that
packaging/install-deps.sh unpacks in /opt/snapguard/compat ("compat"). One containerd per stack
for the session.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapguard_lab.testbed import COMPAT, Containerd

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test on the `containerd` fixture needs the real stack: it is marked `stack` wherever it is."""
    ours = getattr(containerd, "__wrapped__", containerd)  # the fixture's function (pytest 8.4 wraps it)
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.get("containerd", ()) if info is not None else ()
        if any(d.func is ours for d in defs):  # this file's fixture, not a parameter of that name
            item.add_marker(pytest.mark.stack)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked `root` or `stack` fails without root: its need is stated, never skipped."""
    needs = [m.name for m in item.iter_markers() if m.name in ("root", "stack")]
    if needs and os.geteuid() != 0:
        pytest.fail(f"marked {needs[0]}: needs root (run as root, or deselect with -m 'not {needs[0]}')")


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


@pytest.fixture(scope="session", params=["debian12", "compat"])
def containerd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               config_file: Path) -> Iterator[Containerd]:
    stack = request.param
    if os.geteuid() != 0:
        pytest.fail("the containerd tests need root (CI and the README's test command run as root)")
    if stack == "compat" and not os.path.isdir(COMPAT):
        pytest.skip(f"{COMPAT} is absent: packaging/install-deps.sh unpacks containerd 2.1.9 and runc 1.3.6 there")
    ctd = Containerd(str(tmp_path_factory.mktemp(f"containerd-{stack}")),
                     env={"SNAPGUARD_CONFIG": str(config_file),
                          "SNAPGUARD_STATE_DIR": str(tmp_path_factory.mktemp(f"state-{stack}"))},
                     stack=stack)
    ctd.start()
    try:
        ctd.import_counter_image()
        yield ctd
    finally:
        ctd.stop()
