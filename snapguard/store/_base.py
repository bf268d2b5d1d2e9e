"""What every image store does, over the primitives each backend implements (pulls in _pull, the
records and names in _records).

Layout under the store's root (a directory or a bucket prefix):

    <job>/epochs/<n, 12 digits>                 one object per restore of the job (fencing)
    <job>/images/<name>/<file>                  the image's files, as the manifest lists them
    <job>/images/<name>/snapguard-manifest.json
    <job>/images/<name>/snapguard-store.json    the store's record: fencing epoch, sizes, source
    <job>/images/<name>/snapguard-complete.json written last, with a create-only put
    <job>/file-checkpoints/<name>.json          file checkpoints registered with the job

The whole-image rule: an image counts only when its marker is there, and the marker is put only
after every file, the manifest and the store record are, each verified against the manifest's
digests as it was read for the upload. A reader refuses an image without a marker
(UPLOAD_INCOMPLETE) and verifies every byte against the manifest as it arrives (IMAGE_CORRUPT).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from typing import Any, Callable

from .. import image
from ..names import MANIFEST_NAME, MARKER_NAME
from ..reasons import Reason, SnapguardError
from . import _exchange, _fencing, _json, _pull
from ._members import STORE_RECORD, check_member, confirm_members, read_sealed, upload_member
from ._records import ImageRef, Progress, Pulled, check_name, new_image_name

__all__ = ["STORE_RECORD", "Store"]

_SMALL_CAP = image.MAX_MANIFEST_BYTES  # the largest manifest an image may hold
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Store:
    """An image store. Backends implement the primitives (`_put`, `_put_new`, `_get`, `_list`,
    `_delete`, `_upload`, `_download`); keys are '/'-separated, relative to the store's root."""

    scheme = ""

    def __init__(self, url: str) -> None:
        self.url = url

    # ---- primitives -------------------------------------------------------------------------
    def _put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def _put_new(self, key: str, data: bytes) -> bool:
        """Create `key` atomically; False when it exists (nothing changed)."""
        raise NotImplementedError

    def _get(self, key: str, cap: int = _SMALL_CAP) -> bytes | None:
        raise NotImplementedError

    def _list(self, prefix: str) -> list[str]:
        raise NotImplementedError

    def _delete(self, key: str) -> None:
        raise NotImplementedError

    def _upload(self, key: str, fd: int, size: int, progress: Progress) -> list[bytes]:
        """Put the `size` bytes of fd as `key`; the sha256 of each 64 MiB span as read."""
        raise NotImplementedError

    def _download(self, key: str, size: int, out_fd: int, progress: Progress) -> list[bytes]:
        """Write `key` (expected `size` bytes) into out_fd; the sha256 of each span as it arrived."""
        raise NotImplementedError

    # an object sent span by span while its file still grows (StreamingPush): span i of SPAN bytes
    # (the last one shorter) may arrive in any order and from several threads; nothing is
    # visible under `key` before `_commit`, and `_abort` leaves nothing behind
    def _begin(self, key: str) -> Any:
        raise NotImplementedError

    def _part(self, handle: Any, index: int, data: bytes) -> None:
        raise NotImplementedError

    def _commit(self, handle: Any) -> None:
        raise NotImplementedError

    def _abort(self, handle: Any) -> None:
        raise NotImplementedError

    def _sweep(self, prefix: str) -> int:
        """Remove what uploads under `prefix` left that is not an object (a writer killed mid
        upload): temporary files, unfinished multipart uploads. How many were removed."""
        raise NotImplementedError

    # ---- fencing ----------------------------------------------------------------------------
    def take_epoch(self, job: str, expect: int | None = None, note: dict[str, Any] | None = None) -> int:
        return _fencing.take_epoch(self, check_name("job", job), expect, note)

    def attempt_epoch(self, job: str, image_epoch: int, *, force: bool = False,
                      note: dict[str, Any] | None = None) -> int:
        return _fencing.attempt_epoch(self, check_name("job", job), image_epoch, force=force, note=note)

    def abort_epoch(self, job: str, n: int, why: str) -> bool:
        return _fencing.abort_epoch(self, check_name("job", job), n, why)

    def current_epoch(self, job: str) -> int:
        return _fencing.current_epoch(self, check_name("job", job))

    def check_epoch(self, job: str, epoch: int) -> None:
        _fencing.check_epoch(self, check_name("job", job), epoch)

    # ---- listing ----------------------------------------------------------------------------
    def jobs(self) -> list[str]:
        return sorted({k.split("/", 1)[0] for k in self._list("") if "/" in k})

    def images(self, job: str, *, whole_only: bool = True) -> list[ImageRef]:
        """The job's images, oldest first (names sort by time); only whole ones unless told."""
        prefix = f"{check_name('job', job)}/images/"
        names: dict[str, bool] = {}
        for key in self._list(prefix):
            rest = key[len(prefix):]
            if "/" not in rest:
                continue
            name, member = rest.split("/", 1)
            names[name] = names.get(name, False) or member == MARKER_NAME
        refs = []
        for name in sorted(names):
            if whole_only and not names[name]:
                continue
            epoch, invalid = None, None
            if names[name]:
                try:
                    epoch = self._record(job, name).get("epoch")
                except SnapguardError as e:  # a record snapguard did not write: the image does not count
                    if e.reason is not Reason.STORE_RECORD_INVALID:
                        raise
                    invalid = e.failure.message
                    _json.log.warning("%s: image %s of job %s does not count: %s", self.url, name, job, invalid)
            complete = names[name] and invalid is None
            if whole_only and not complete:
                continue
            refs.append(ImageRef(self.url, job, name, complete, epoch if isinstance(epoch, int) else None, invalid))
        return refs

    def newest(self, job: str) -> ImageRef | None:
        """The newest whole image whose store record and marker are ones snapguard writes; an
        image with a bad one is skipped (logged), never in the way of an older good one."""
        for ref in reversed(self.images(job)):
            try:
                _json.read_record(self, f"{job}/images/{ref.name}/{MARKER_NAME}", _json.MARKER,
                                  cap=_json.MAX_MARKER_BYTES)
            except SnapguardError as e:
                if e.reason is not Reason.STORE_RECORD_INVALID:
                    raise
                _json.log.warning("%s: image %s of job %s does not count: %s", self.url, ref.name, job, e)
                continue
            return ref
        return None

    def _record(self, job: str, name: str) -> dict[str, Any]:
        """The image's store record ({} when there is none); STORE_RECORD_INVALID when it is not
        one snapguard writes (snapguard.store._json)."""
        key = f"{job}/images/{name}/{STORE_RECORD}"
        record = _json.read_record(self, key, _json.STORE_RECORD) or {}
        for field_name, want in (("job", job), ("name", name)):
            if record.get(field_name, want) != want:
                raise SnapguardError(Reason.STORE_RECORD_INVALID, f"{key}: field {field_name} is "
                                     f"{str(record[field_name])[:130]!r}, not {want!r} (a record of another image)",
                                     evidence={"store": self.url, "key": key})
        return record

    # ---- file checkpoints -------------------------------------------------------------------
    def register_file_checkpoint(self, job: str, location: str) -> str:
        """Record a whole file checkpoint (a path or URL) of the job; the newest is the fallback."""
        name = new_image_name()
        data = json.dumps({"location": location, "time": time.time(), "host": socket.gethostname()}).encode()
        if not self._put_new(f"{check_name('job', job)}/file-checkpoints/{name}.json", data):
            raise SnapguardError(Reason.STORE_UNREACHABLE, f"file checkpoint record {name} already exists")
        return name

    def newest_file_checkpoint(self, job: str) -> str | None:
        """The location of the job's newest file checkpoint whose record is one snapguard writes;
        a bad record is skipped (logged) and the next older one is used."""
        keys = sorted(k for k in self._list(f"{check_name('job', job)}/file-checkpoints/") if k.endswith(".json"))
        for key in reversed(keys):
            try:
                record = _json.read_record(self, key, _json.FILE_CHECKPOINT)
            except SnapguardError as e:
                if e.reason is not Reason.STORE_RECORD_INVALID:
                    raise
                _json.log.warning("%s: file checkpoint record skipped: %s", self.url, e)
                continue
            if record is not None:
                return str(record["location"])
        return None

    # ---- push -------------------------------------------------------------------------------
    def push(self, image_dir: str, job: str, *, name: str | None = None, epoch: int = 0,
             progress: Progress | None = None, deadline_s: float | None = None) -> ImageRef:
        """Upload the sealed image in image_dir as the job's image `name` under fencing `epoch`.

        Refused with FENCED before anything is written when a newer epoch exists (and checked
        again before the marker, the commit point). Every file is verified against the manifest
        as it is read for the upload; the marker is put last, create-only. On any failure what
        was put is deleted (best effort); an upload that dies leaves no marker. The whole push
        ends within `deadline_s` (else `progress.deadline_s`, else one from the image's size:
        snapguard.store._exchange), or fails with STORE_TOO_SLOW."""
        progress = progress or Progress()
        with _exchange.operation(deadline_s if deadline_s is not None else progress.deadline_s, f"push {job}"):
            return self._push(image_dir, job, name, epoch, progress)

    def _push(self, image_dir: str, job: str, name: str | None, epoch: int, progress: Progress) -> ImageRef:
        job = check_name("job", job)
        name = check_name("image", name or new_image_name())
        self.check_epoch(job, epoch)
        dir_fd = _open_local(image_dir)
        try:
            marker, manifest_bytes, manifest = read_sealed(dir_fd, image_dir)
            prefix = f"{job}/images/{name}/"
            if self._list(prefix):
                raise SnapguardError(Reason.USAGE_ERROR, f"the store already holds image {name} of job {job}")
            files = manifest["files"]
            total = sum(int(e["size"]) for e in files.values())
            progress = progress or Progress()
            progress.start(total, f"push {job}/{name}")
            _exchange.by_size(total, f"push {job}/{name}")
            written: list[str] = []
            try:
                for fname, entry in sorted(files.items()):
                    check_member(fname)
                    written.append(prefix + fname)
                    upload_member(self, dir_fd, image_dir, prefix, fname, entry, progress)
                written += [prefix + MANIFEST_NAME, prefix + STORE_RECORD]
                ref = self._commit_image(job, name, epoch, manifest_bytes, marker, len(files), total)
            except BaseException:
                with _exchange.cleanup(f"remove the failed push {job}/{name}"):
                    for key in reversed(written):
                        try:
                            self._delete(key)
                        except Exception:  # best effort: an unmarked leftover never counts
                            pass
                raise
            progress.report(final=True)
        finally:
            os.close(dir_fd)
        return ref

    def discard_partial(self, job: str, name: str) -> int:
        """Remove an image whose upload never finished (a writer killed mid upload): every object
        under it and what the dead writer left half sent. Refused for a whole image (a marker is
        a commit). Returns how many things were removed."""
        prefix = f"{check_name('job', job)}/images/{check_name('image', name)}/"
        if self._get(prefix + MARKER_NAME, 4096) is not None:
            raise SnapguardError(Reason.USAGE_ERROR, f"image {name} of job {job} is whole: not discarded")
        keys = self._list(prefix)
        for key in keys:
            self._delete(key)
        return len(keys) + self._sweep(prefix)

    def delete_image(self, job: str, name: str) -> int:
        """Delete an image, its marker first (from then on it no longer counts), then every file
        and whatever an unfinished upload left under it. How many things were removed."""
        prefix = f"{check_name('job', job)}/images/{check_name('image', name)}/"
        self._delete(prefix + MARKER_NAME)
        keys = self._list(prefix)
        for key in keys:
            self._delete(key)
        return len(keys) + self._sweep(prefix)

    def prune(self, job: str, keep: int) -> list[str]:
        """Keep the job's `keep` newest whole images; delete the older whole ones and every
        unmarked one older than the newest whole image (an upload that died). Returns the names
        deleted. An unmarked image newer than every whole one may be an upload under way: kept."""
        if keep < 1:
            raise SnapguardError(Reason.USAGE_ERROR, f"--keep {keep}: keep at least the newest whole image")
        refs = self.images(job, whole_only=False)
        whole = [r.name for r in refs if r.complete]
        newest = whole[-1] if whole else None
        doomed = [n for n in whole[:-keep]] + [r.name for r in refs if not r.complete and newest and r.name < newest]
        for name in sorted(doomed):
            self.delete_image(job, name)
        return sorted(doomed)

    def stream(self, image_dir: str, job: str, *, name: str | None = None, epoch: int = 0,
               progress: Progress | None = None, parallel: int = 4, deadline_s: float | None = None) -> Any:
        """Start uploading the image being written into image_dir (see snapguard.store._stream);
        refused with FENCED before anything is sent when a newer epoch exists. Returns the
        running StreamingPush: `finish()` after the seal, `abort()` on failure. `deadline_s` (else
        `progress.deadline_s`) bounds it from now to the end of `finish()`."""
        from ._stream import StreamingPush

        job = check_name("job", job)
        name = check_name("image", name or new_image_name())
        self.check_epoch(job, epoch)
        if self._list(f"{job}/images/{name}/"):
            raise SnapguardError(Reason.USAGE_ERROR, f"the store already holds image {name} of job {job}")
        progress = progress or Progress()
        deadline_s = deadline_s if deadline_s is not None else progress.deadline_s
        return StreamingPush(self, image_dir, job, name, epoch, progress, parallel=parallel,
                             deadline_s=deadline_s).start()

    def _commit_image(self, job: str, name: str, epoch: int, manifest_bytes: bytes, marker: bytes, nfiles: int,
                      total: int) -> ImageRef:
        """Every file is in the store: the manifest, the store record, the fencing check, and
        last the create-only marker (the commit point)."""
        prefix = f"{job}/images/{name}/"
        record = {"epoch": epoch, "job": job, "name": name, "files": nfiles, "image_bytes": total,
                  "host": socket.gethostname(), "time": time.time(),
                  "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest()}
        record_bytes = json.dumps(record, sort_keys=True).encode()
        self._put(prefix + MANIFEST_NAME, manifest_bytes)
        self._put(prefix + STORE_RECORD, record_bytes)
        confirm_members(self, prefix, manifest_bytes, len(record_bytes))  # every object there, whole
        self.check_epoch(job, epoch)  # a restore elsewhere since? then no marker
        if not self._put_new(prefix + MARKER_NAME, marker):
            raise SnapguardError(Reason.UPLOAD_INCOMPLETE, f"image {name} of job {job} was marked by "
                                 "another writer while this one uploaded it")
        return ImageRef(self.url, job, name, True, epoch)

    # ---- pull -------------------------------------------------------------------------------
    def pull(self, ref: ImageRef | str, dest: str, *, job: str | None = None, progress: Progress | None = None,
             check_manifest: Callable[[dict[str, Any]], None] | None = None, durable: bool = True,
             deadline_s: float | None = None) -> Pulled:
        """Fetch an image (a ref, or a name with `job`) into `dest`, a new or empty private
        directory, verifying every byte against the manifest as it arrives; the local marker is
        written last. No marker in the store: UPLOAD_INCOMPLETE; a byte that differs:
        IMAGE_CORRUPT, and dest is removed. `check_manifest(manifest)` runs before any file is
        fetched (a host check refuses there without moving the image). `durable=False` (a restore
        that uses the copy at once) skips each file's fsync: the copy was verified as it was
        written, and a later restore of the directory, after a crash, verifies every byte again.
        The whole pull ends within `deadline_s` (else `progress.deadline_s`, else one from the
        image's size), or fails with STORE_TOO_SLOW and dest is removed."""
        if isinstance(ref, str):
            ref = ImageRef(self.url, check_name("job", job or ""), check_name("image", ref), True)
        progress = progress or Progress()
        with _exchange.operation(deadline_s if deadline_s is not None else progress.deadline_s, f"pull {ref.job}"):
            return _pull.pull(self, ref, dest, progress, check_manifest, durable)

    def _stored(self, prefix: str) -> dict[str, int | None]:
        """The objects under `prefix`, each with its size where the backend lists one (None where
        it does not); a backend that can check more (an ETag) refuses here what does not match."""
        return dict.fromkeys(self._list(prefix))


def _open_local(image_dir: str) -> int:
    try:
        fd = os.open(image_dir, _O_DIR)
    except OSError as e:
        raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"image directory {image_dir}: {e.strerror}",
                             evidence={"image": image_dir}) from None
    st = os.fstat(fd)
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        os.close(fd)
        raise SnapguardError(Reason.UNTRUSTED_PATH, f"image directory {image_dir} is not root's alone",
                             evidence={"image": image_dir})
    return fd

