"""The image's trust checks that need root: an image directory, a directory above it or an image
file owned by another user (chown), and a device node in the image (mknod). The rest of the
image's checks are in tests/unit/test_image.py."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from snapguard import image
from snapguard.reasons import Reason, SnapguardError
from tests.trusted import image_fields, sealed_image

pytestmark = pytest.mark.root

NOBODY = 65534


@pytest.fixture
def sealed(tmp_path: Path) -> Path:
    return sealed_image(tmp_path / "img")


def _refusal(d: Path) -> SnapguardError:
    with pytest.raises(SnapguardError) as e:
        image.verify(str(d))
    assert "\n" not in str(e.value)
    return e.value


def test_seal_refuses_a_device_node(tmp_path: Path) -> None:
    d = tmp_path / "img"
    d.mkdir()
    (d / "core-1.img").write_bytes(b"core")
    odd = d / "odd.img"
    os.mknod(odd, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    t0 = time.monotonic()
    with pytest.raises(SnapguardError) as e:
        image.seal(str(d), image_fields())
    assert time.monotonic() - t0 < 5
    assert e.value.reason is Reason.IMAGE_WRITE_FAILED and "odd.img" in str(e.value)
    assert not (d / image.MARKER_NAME).exists()


def test_image_dir_owned_by_another_user_is_untrusted(sealed: Path) -> None:
    os.chown(sealed, NOBODY, NOBODY)
    e = _refusal(sealed)
    assert e.reason is Reason.UNTRUSTED_PATH and "uid 65534" in str(e)


def test_image_dir_under_another_users_directory_is_untrusted(tmp_path: Path) -> None:
    parent = tmp_path / "theirs"
    parent.mkdir()
    d = parent / "img"
    d.mkdir()
    (d / "core-1.img").write_bytes(b"core")
    image.seal(str(d), image_fields())
    os.chown(parent, NOBODY, NOBODY)
    e = _refusal(d)
    assert e.reason is Reason.UNTRUSTED_PATH and e.failure.evidence["image"] == str(d)


@pytest.mark.parametrize("name", ["pages-1.img", image.MANIFEST_NAME])
def test_image_file_owned_by_another_user_is_untrusted(sealed: Path, name: str) -> None:
    os.chown(sealed / name, NOBODY, NOBODY)
    e = _refusal(sealed)
    assert e.reason is Reason.UNTRUSTED_PATH and name in str(e)
