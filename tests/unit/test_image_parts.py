"""bench/gpu/image_parts.py: CRIU's pagemap and mm images decoded (protobuf, written here as CRIU
writes them), every dumped page attributed to its VMA and kind, shared memory once, the spill and
CRIU's other files apart, and VMAs gone from the live process told apart from those still mapped."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))

import image_parts  # noqa: E402

PAGE = 4096
HEAP, ANON, FILE_PRIVATE = (1 << 5) | 1, (1 << 9) | 1, (1 << 6) | 1


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _msg(*fields: tuple[int, int | bytes]) -> bytes:
    out = b""
    for num, value in fields:
        if isinstance(value, bytes):
            out += _varint(num << 3 | 2) + _varint(len(value)) + value
        else:
            out += _varint(num << 3) + _varint(value)
    return out


def _image(path: Path, entries: list[bytes]) -> None:
    data = (0x54564319).to_bytes(4, "little") + (0x56084025).to_bytes(4, "little")
    path.write_bytes(data + b"".join(len(e).to_bytes(4, "little") + e for e in entries))


def _vma(start: int, end: int, status: int) -> bytes:
    return _msg((1, start), (2, end), (3, 0), (4, 0), (5, 3), (6, 0x22), (7, status), (8, 0))


def test_pages_by_vma_kind_and_whether_still_mapped(tmp_path: Path) -> None:
    pid = 4242
    vmas = [_vma(0x10000, 0x20000, HEAP), _vma(0x7F0000000000, 0x7F0000100000, ANON),
            _vma(0x7F0000100000, 0x7F0000200000, ANON), _vma(0x7F1000000000, 0x7F1000010000, FILE_PRIVATE)]
    _image(tmp_path / f"mm-{pid}.img", [_msg(*((1, 0),) * 12, *((14, v) for v in vmas))])
    _image(tmp_path / f"pagemap-{pid}.img", [
        _msg((1, 1)),
        _msg((1, 0x10000), (2, 0), (4, 4), (5, 3)),                # 3 heap pages (nr_pages in field 5)
        _msg((1, 0x7F00000FF000), (2, 2), (4, 4)),                 # spans both anon VMAs: 1 + 1
        _msg((1, 0x7F0000180000), (2, 16), (4, 4)),                # 16 more in the second
        _msg((1, 0x7F1000000000), (2, 1), (4, 4)),                 # 1 written page of a library
        _msg((1, 0x7F1000001000), (2, 5), (4, 1)),                 # in the parent image: not here
    ])
    _image(tmp_path / "pagemap-shmem-7.img", [_msg((1, 2)), _msg((1, 0), (2, 2), (4, 4))])
    # the process's present pages in pagemap order (the zero ones: 2 heap, 2 + 8 anon), shared
    # memory's in its own pages file (pagemap-shmem-7's pages_id 2), both zero
    data = b"h" * PAGE + bytes(2 * PAGE) + bytes(2 * PAGE) + (b"a" * PAGE + bytes(PAGE)) * 8 + b"f" * PAGE
    (tmp_path / "pages-1.img").write_bytes(data)
    (tmp_path / "pages-2.img").write_bytes(bytes(2 * PAGE))
    (tmp_path / "snapguard-take-4242.bin").write_bytes(b"\0" * 10000)
    out = image_parts.account(str(tmp_path))
    assert out["pages_file_matches"] and out["dumped_page_bytes"] == 24 * PAGE
    assert out["pages_by_kind"] == {"anon private": 18 * PAGE, "heap": 3 * PAGE, "anon shared (shmem)": 2 * PAGE,
                                    "file private": PAGE}
    assert out["files_bytes"]["spill"] == 10000 and out["files_bytes"]["pages"] == 24 * PAGE
    assert out["zero_page_bytes_by_kind"] == {"anon private": 10 * PAGE, "heap": 2 * PAGE,
                                              "anon shared (shmem)": 2 * PAGE, "file private": 0}
    assert out["zero_page_bytes"] == 14 * PAGE
    # against a live process: this test's own, where none of these addresses is mapped
    gone = image_parts.account(str(tmp_path), os.getpid())
    assert gone["pages_by_kind"]["anon private, gone after the dump"] == 18 * PAGE
    assert gone["largest_vmas"][0]["dumped"] == 17 * PAGE and gone["largest_vmas"][0]["mapped_after"] is False
