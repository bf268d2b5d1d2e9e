"""snapguard.prefetch: the ELF closure against the loader's own answer (ldd), scripts and files
that are no ELF, and read-ahead that follows no link into an image and opens nothing but a
regular file. Real binaries of this machine, no fakes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from snapguard import prefetch

LDD = "/usr/bin/ldd"


def _ldd(path: str) -> set[str]:
    out = subprocess.run([LDD, path], capture_output=True, text=True, timeout=30, check=True).stdout
    found = set()
    for line in out.splitlines():
        target = line.split("=>", 1)[-1].split("(", 1)[0].strip()
        if target.startswith("/"):
            found.add(os.path.realpath(target))
    return found


@pytest.mark.skipif(not os.path.exists(LDD), reason="no ldd")
@pytest.mark.parametrize("binary", [sys.executable, "/usr/bin/ssh", "/usr/local/sbin/criu"])
def test_closure_finds_what_the_loader_loads(binary: str) -> None:
    if not os.path.exists(binary):
        pytest.skip(f"no {binary}")
    real = os.path.realpath(binary)
    found = {os.path.realpath(p) for p in prefetch.closure(real)}
    assert real in found
    assert _ldd(real) <= found, sorted(_ldd(real) - found)


def test_closure_of_a_script_adds_its_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "tool"
    script.write_text(f"#!{sys.executable} -I\nprint(1)\n")
    found = prefetch.closure(str(script))
    assert found[0] == str(script) and found[1] == sys.executable
    assert set(prefetch.closure(sys.executable)) <= set(found)


def test_closure_of_what_is_no_elf_is_the_file_alone(tmp_path: Path) -> None:
    text = tmp_path / "text"
    text.write_text("no elf\n")
    cut = tmp_path / "cut"
    cut.write_bytes(Path(sys.executable).resolve().read_bytes()[:100])  # a header, no program headers
    assert prefetch.closure(str(text)) == [str(text)]
    assert prefetch.closure(str(cut)) == [str(cut)]
    assert prefetch.closure(str(tmp_path / "missing")) == []
    assert prefetch.closure(str(tmp_path)) == []  # a directory


def test_read_ahead_counts_each_file_once(tmp_path: Path) -> None:
    exe = os.path.realpath(sys.executable)
    files, size = prefetch.read_ahead([exe])
    closure = prefetch.closure(exe)
    assert files == len(closure) and size == sum(os.stat(p).st_size for p in closure)
    assert prefetch.read_ahead([exe], wait=True) == (files, size)  # read through: the same files
    copy = tmp_path / "copy"
    shutil.copy(exe, copy)  # another file, the same libraries: only itself is new
    again_files, again_size = prefetch.read_ahead([exe, str(copy)])
    assert again_files == files + 1 and again_size == size + copy.stat().st_size


def test_criu_plugins_are_every_so_name_a_link_among_them(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere.so"
    real.write_bytes(b"\x7fELF")
    libdir = tmp_path / "lib"
    libdir.mkdir()
    (libdir / "b_plugin.so").write_bytes(b"\x7fELF")
    (libdir / "a_link.so").symlink_to(real)  # CRIU dlopen()s it through the link: read ahead too
    (libdir / "notes.txt").write_text("x")
    (libdir / "sub.so.d").mkdir()
    assert prefetch.criu_plugins(str(libdir)) == [str(libdir / "a_link.so"), str(libdir / "b_plugin.so")]
    files, size = prefetch.read_ahead(prefetch.criu_plugins(str(libdir)), wait=True)
    assert files == 2 and size == 8
    assert prefetch.criu_plugins(str(tmp_path / "missing")) == []


def test_willneed_at_follows_no_link_and_opens_only_regular_files(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"x" * 5000)
    img = tmp_path / "img"
    img.mkdir()
    (img / "core-1.img").write_bytes(b"c" * 100)
    (img / "link.img").symlink_to(outside)
    os.mkfifo(img / "fifo.img")  # opened with O_NONBLOCK and left alone: no hang
    (img / "dir.img").mkdir()
    fd = os.open(img, os.O_RDONLY | os.O_DIRECTORY)
    try:
        names = ["core-1.img", "link.img", "fifo.img", "dir.img", "missing.img", "../outside", ".."]
        assert prefetch.willneed_at(fd, names) == (1, 100)
        assert prefetch.willneed_at(fd, names, wait=True) == (1, 100)
    finally:
        os.close(fd)


def test_a_damaged_elf_header_is_read_as_nothing_more(tmp_path: Path) -> None:
    """Offsets and counts a damaged file makes up (past the file, past what an offset can be,
    bytes at random) never raise: the file alone, or what its intact part names."""
    import random
    import struct

    good = Path(os.path.realpath(sys.executable)).read_bytes()[:65536]
    rng = random.Random(7)
    cases = [(32, "<Q", 2**64 - 1), (32, "<Q", 2**40), (54, "<H", 0xFFFF), (56, "<H", 0xFFFF), (54, "<H", 1)]
    for n, (offset, fmt, value) in enumerate(cases):
        data = bytearray(good)
        struct.pack_into(fmt, data, offset, value)
        path = tmp_path / f"bad-{n}"
        path.write_bytes(bytes(data))
        assert prefetch.closure(str(path))[0] == str(path)
    for n in range(20):
        data = bytearray(good)
        for _ in range(50):
            data[rng.randrange(16, len(data))] = rng.randrange(256)
        path = tmp_path / f"noise-{n}"
        path.write_bytes(bytes(data))
        assert prefetch.closure(str(path))[0] == str(path)
