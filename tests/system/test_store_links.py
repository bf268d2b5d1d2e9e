"""The file:// store never follows a link inside it: real symbolic links in a real store
directory (a linked epochs directory, a linked image directory, a linked job directory) are
refused with UNTRUSTED_PATH and nothing outside the store is created, read or deleted; reading a
store that does not exist creates nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapguard import image
from snapguard.procfs import host_facts
from snapguard.reasons import Reason, SnapguardError
from snapguard.store import open_store

pytestmark = pytest.mark.root  # a store is root's alone


def sealed(root: Path) -> Path:
    d = root / "sealed"
    d.mkdir(mode=0o700, parents=True)
    (d / "pages-1.img").write_bytes(os.urandom(8192))
    image.seal(str(d), {"criu_version": "4.2.1", "host": host_facts(), "processes": []})
    return d


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def refused(fn) -> Reason:
    with pytest.raises(SnapguardError) as e:
        fn()
    return e.value.reason


def test_an_epoch_is_never_created_through_a_linked_epochs_directory(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/store")
    store.push(str(sealed(tmp_path)), "train")
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    os.symlink(outside, tmp_path / "store" / "train" / "epochs")
    assert refused(lambda: store.take_epoch("train")) is Reason.UNTRUSTED_PATH
    assert refused(lambda: store.attempt_epoch("train", 0)) is Reason.UNTRUSTED_PATH
    assert refused(lambda: store.current_epoch("train")) is Reason.UNTRUSTED_PATH
    assert tree(outside) == []


def test_a_pull_never_fetches_through_a_linked_image_directory(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/store")
    name = store.push(str(sealed(tmp_path)), "train").name
    images = tmp_path / "store" / "train" / "images"
    outside = tmp_path / "outside"
    os.rename(images / name, outside)  # the image's objects now outside the store, a link in their place
    os.symlink(outside, images / name)
    dest = tmp_path / "pulled"
    assert refused(lambda: store.pull(name, str(dest), job="train")) is Reason.UNTRUSTED_PATH
    assert not dest.exists() or tree(dest) == []
    assert store.images("train") == [] and store.newest("train") is None  # a link is not an image


def test_a_prune_never_deletes_through_a_linked_job_directory(tmp_path: Path) -> None:
    other = open_store(f"file://{tmp_path}/other")
    for _ in range(2):
        other.push(str(sealed(tmp_path / f"s{len(os.listdir(tmp_path))}")), "train")
    before = tree(tmp_path / "other")
    store = open_store(f"file://{tmp_path}/store")
    store.push(str(sealed(tmp_path / "mine")), "mine")
    os.symlink(tmp_path / "other" / "train", tmp_path / "store" / "train")
    assert refused(lambda: store.prune("train", 1)) is Reason.UNTRUSTED_PATH
    assert tree(tmp_path / "other") == before
    assert store.jobs() == ["mine"]


def test_reading_a_store_that_does_not_exist_creates_nothing(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/absent/store")
    assert store.jobs() == [] and store.images("train") == [] and store.newest("train") is None
    assert store.current_epoch("train") == 0
    assert not (tmp_path / "absent").exists()
    store.push(str(sealed(tmp_path)), "train")  # the first write makes it, root's alone
    assert oct((tmp_path / "absent" / "store").stat().st_mode & 0o777) == "0o700"
    assert [r.name for r in store.images("train")]
