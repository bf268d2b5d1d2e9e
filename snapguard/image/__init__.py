"""The compatibility manifest and the integrity of an image directory.

At checkpoint (`seal`): every file of the image is hashed into the manifest (sha256 over the
sha256s of its 64 MiB spans, so that large page files hash on every core; `hashing`), the
manifest is written 0600, and a completion marker holding the manifest's sha256 is written last.
At restore (`inspect`, `verify`): no marker means a half-written or half-copied image; a changed
file or manifest means corruption; and the manifest, which may come from another host, is
validated against a JSON Schema (manifest.schema.json) before anything reads it, into a
`Manifest` (`manifest`).

snapguard runs as root and an image directory may have passed through other hands, so neither
seal nor verify ever follows a link (`_io`). CRIU images are flat: a symlink, FIFO, device,
socket or subdirectory in an image is refused. At restore the directory must be root's alone
(and every directory above it, see snapguard.trust), each file must be root's and not writable by
others, and nothing the manifest does not list may sit in the directory.
"""

from __future__ import annotations

from ..names import MANIFEST_NAME as MANIFEST_NAME
from ..names import MARKER_NAME as MARKER_NAME
from ._io import MAX_MANIFEST_BYTES as MAX_MANIFEST_BYTES
from .hashing import PageFileHasher as PageFileHasher
from .hashing import SpanDigests as SpanDigests
from .manifest import SCHEMA as SCHEMA
from .manifest import FileEntry as FileEntry
from .manifest import ImageHost as ImageHost
from .manifest import Manifest as Manifest
from .manifest import ProcessEntry as ProcessEntry
from .manifest import compare_with_host as compare_with_host
from .manifest import validate_manifest as validate_manifest
from .sealing import seal as seal
from .verifying import Inspected as Inspected
from .verifying import inspect as inspect
from .verifying import verify as verify

__all__ = ["MANIFEST_NAME", "MARKER_NAME", "MAX_MANIFEST_BYTES", "SCHEMA", "FileEntry", "ImageHost", "Inspected", "Manifest",
           "PageFileHasher", "ProcessEntry", "SpanDigests", "compare_with_host", "inspect", "seal",
           "validate_manifest", "verify"]
