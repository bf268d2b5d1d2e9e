"""Image stores off the node, chosen by URL: `file:///shared/dir` and `s3://bucket/prefix`.

    store = open_store("s3://snaps/train")        # or file:///mnt/snaps
    ref = store.push(image_dir, job, epoch=e)     # files + manifest + record, then the marker
    store.newest(job) -> ImageRef | None          # the newest WHOLE image (marker present)
    pulled = store.pull(ref, dest)                # verified while read; local marker last
    store.take_epoch(job, expect=seen)            # fencing: create-only, one winner
    store.check_epoch(job, e)                     # FENCED when a newer epoch exists
    record_published(store, PublishedImage(...))  # an OCI checkpoint image of the job (_published)
    catalog(store, job) -> [StoredImage]          # every image, record and manifest read (_catalog)

Failures are SnapguardError with a typed reason: STORE_UNREACHABLE, STORE_TOO_SLOW,
STORE_WRITE_UNCONFIRMED, STORE_RECORD_INVALID, UPLOAD_INCOMPLETE, FENCED, IMAGE_CORRUPT,
IMAGE_INCOMPLETE, MANIFEST_INVALID. Every exchange with a store and every push or pull has a
deadline (`deadline_s=`; snapguard.store._exchange says which).
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from ..reasons import Reason, SnapguardError
from ._base import STORE_RECORD, Store
from ._catalog import StoredImage, catalog, split_image_url, stored_image
from ._digest import SPAN, SpanHasher, combine
from ._published import PublishedImage, newest_file_checkpoint_time, newest_published, record_published
from ._json import load_record
from ._records import ImageRef, Progress, Pulled, check_name, terminal_progress

__all__ = ["SPAN", "STORE_RECORD", "ImageRef", "Progress", "PublishedImage", "Pulled", "SpanHasher", "Store",
           "StoredImage", "catalog", "check_name", "combine", "load_record", "newest_file_checkpoint_time", "newest_published", "open_store",
           "record_published", "split_image_url", "stored_image", "terminal_progress"]


def open_store(url: str, *, endpoint_url: str | None = None, parallel: int = 4) -> Store:
    """The store at `url`: file:///absolute/dir or s3://bucket[/prefix] (endpoint: `endpoint_url`,
    else $S3_ENDPOINT_URL or boto3's AWS_ENDPOINT_URL_S3)."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise SnapguardError(Reason.USAGE_ERROR, f"store URL {url}: file:// takes an absolute path "
                                 "(file:///mnt/snaps)")
        from ._file import FileStore

        return FileStore(url, unquote(parts.path))
    if parts.scheme == "s3":
        if not parts.netloc:
            raise SnapguardError(Reason.USAGE_ERROR, f"store URL {url}: s3:// needs a bucket (s3://bucket/prefix)")
        from ._s3 import S3Store

        return S3Store(url, parts.netloc, unquote(parts.path), endpoint_url=endpoint_url, parallel=parallel)
    raise SnapguardError(Reason.USAGE_ERROR, f"store URL {url}: the scheme must be file:// or s3://")
