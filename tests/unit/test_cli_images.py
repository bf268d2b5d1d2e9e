"""`snapguard images` and `snapguard inspect` over a file:// store the test fills with real sealed
images (image.seal over image files, as the store's tests make them), and store contents that
are not what snapguard writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from snapguard import cli, image
from snapguard.procfs import host_facts
from snapguard.store import open_store

GPU = {"driver_version": "580.65.06", "cuda_driver_version": 13000,
       "gpus": [{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-0a", "pci_bus_id": "00000000:01:00.0", "minor": 0,
                 "compute_capability": "9.0", "memory_total": 150 << 30, "used_by_image": 3 << 30},
                {"index": 1, "name": "NVIDIA H200", "uuid": "GPU-1b", "pci_bus_id": "00000000:02:00.0", "minor": 1,
                 "compute_capability": "9.0", "memory_total": 150 << 30, "used_by_image": 0}]}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def store(tmp_path: Path) -> tuple[str, Path, list[str]]:
    """job `train`: an image pushed under epoch 0, then a restore (epoch 1) and an image under it;
    job `eval`: one unmarked (an upload that died)."""
    d = tmp_path / "img"
    d.mkdir(mode=0o700)
    (d / "pages-1.img").write_bytes(os.urandom(300_000))
    (d / "core-1.img").write_bytes(b"core")
    image.seal(str(d), {"container_id": "c1", "criu_version": "4.2.1", "host": host_facts(),
                        "processes": [{"pid": 41, "nspid": 1, "comm": "python3", "gpu": True,
                                       "gpu_memory_bytes": 3 << 30, "rss_bytes": 200 << 20}],
                        "gpu": GPU, "take_point": {"41": {"ok": True, "step": 80, "wait_s": 0.4}}})
    url = f"file://{tmp_path}/store"
    s = open_store(url)
    names = [s.push(str(d), "train", epoch=0, name="20260101T000000.000000Z").name]
    s.take_epoch("train")
    names.append(s.push(str(d), "train", epoch=1, name="20260102T000000.000000Z").name)
    s.push(str(d), "eval", epoch=0, name="20260103T000000.000000Z")
    os.unlink(tmp_path / "store" / "eval" / "images" / "20260103T000000.000000Z" / image.MARKER_NAME)
    return url, d, names


def test_images_lists_whole_images_with_their_columns(store, capsys) -> None:
    url, _, names = store
    code, out, _ = run_cli(capsys, "images", "--store", url)
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["JOB", "NAME", "EPOCH", "SIZE", "AGE", "HOST", "GPUS", "STATUS"]
    cells = [r.split() for r in rows]
    assert [(c[0], c[1], c[2], c[6], c[7]) for c in cells] == [
        ("train", names[0], "0", "1xH200", "Superseded"), ("train", names[1], "1", "1xH200", "Whole")]
    assert all(c[3].endswith("KiB") and c[5] == host_facts()["hostname"] for c in cells)
    code, out, _ = run_cli(capsys, "images", "--store", url, "--all", "--json")
    rows = json.loads(out)
    assert [(r["job"], r["status"], r["superseded"], r["job_epoch"]) for r in rows] == [
        ("eval", "incomplete", False, 0), ("train", "superseded", True, 1), ("train", "whole", False, 1)]
    assert rows[2]["gpus"] == [{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-0a", "used_by_image": 3 << 30}]


def test_images_of_an_unknown_job_or_store_is_not_an_empty_list(store, tmp_path: Path, capsys) -> None:
    url, _, _ = store
    code, out, err = run_cli(capsys, "images", "--store", url, "--job", "trian")
    assert code == 2 and out == "" and err.startswith("snapguard STORE_JOB_NOT_FOUND: ")
    code, _, err = run_cli(capsys, "images", "--store", f"file://{tmp_path}/nothing-here")
    assert code == 2 and "no job at all" in err and not (tmp_path / "nothing-here").exists()


def test_a_store_record_snapguard_did_not_write_is_shown_invalid(store, tmp_path: Path, capsys) -> None:
    url, _, names = store
    rec = tmp_path / "store" / "train" / "images" / names[1] / "snapguard-store.json"
    rec.write_text(json.dumps({"epoch": "1; rm -rf /"}))
    code, out, _ = run_cli(capsys, "images", "--store", url, "--all", "--json")
    bad = [r for r in json.loads(out) if r["name"] == names[1]][0]
    assert code == 0 and bad["status"] == "invalid" and "STORE_RECORD_INVALID" in bad["invalid"]


def test_inspect_url_shows_processes_gpus_take_point_and_host_checks(store, capsys) -> None:
    url, _, names = store
    code, out, _ = run_cli(capsys, "inspect", f"{url}/train/images/{names[0]}")
    assert code == 0
    assert "pushed under epoch 0; the job's epoch is 1, SUPERSEDED" in out
    assert any(line.split()[:4] == ["41", "1", "python3", "yes"] for line in out.splitlines())
    assert "GPU-0a" in out and "(1 used by the image)" in out and "pid 41: ok True, step 80" in out
    assert any(line.split()[:2] == ["image-vs-host", "ok"] for line in out.splitlines())
    code, out, _ = run_cli(capsys, "inspect", f"{url}/train/images/{names[1]}", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["manifest"]["processes"][0]["comm"] == "python3" and doc["status"] == "whole"


def test_inspect_dir_verifies_and_runs_the_restore_checks(store, tmp_path: Path, monkeypatch, capsys) -> None:
    _, d, _ = store
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    monkeypatch.setenv("SNAPGUARD_CONFIG", str(cfg))
    monkeypatch.setenv("SNAPGUARD_STATE_DIR", str(tmp_path / "state"))
    code, out, _ = run_cli(capsys, "inspect", str(d), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["image"] == str(d)
    assert {"image", "image-vs-host", "gpu-vs-host"} <= {c["name"] for c in doc["checks"]}
    (d / "pages-1.img").write_bytes(b"x" * 10)
    code, out, err = run_cli(capsys, "inspect", str(d))
    assert code == 1 and out == "" and err.startswith("snapguard IMAGE_CORRUPT: ")


@pytest.mark.parametrize("target", ["file:///s/train/nope", "file:///s/../images/x"])
def test_inspect_of_what_is_not_an_image_url_is_a_usage_error(target: str, capsys) -> None:
    code, _, err = run_cli(capsys, "inspect", target)
    assert code == 2 and err.startswith("snapguard USAGE_ERROR: ") and err.count("\n") == 1
