"""Push an OCI image layout's image to a registry over the distribution API (no docker).

    python3 oci_push.py LAYOUT_DIR REGISTRY/REPOSITORY:TAG [--plain-http]

The one manifest in LAYOUT_DIR/index.json, its config and its layers: once every blob matched its
digest, each blob the registry lacks (HEAD) is uploaded whole (POST, then PUT with its digest), then
the manifest is PUT under the tag.
Every exchange has a deadline; an answer the registry gives that is not the API's is one line on
stderr and exit 1. Credentials: none (a registry that asks for them is refused).
"""

from __future__ import annotations

import hashlib
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

TIMEOUT_S = 120
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


class PushError(Exception):
    """One line: what the registry or the layout did wrong."""


def _request(method: str, url: str, data: bytes | None = None, headers: dict[str, str] | None = None
             ) -> tuple[int, dict[str, str]]:
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            resp.read(1 << 20)
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}
    except (urllib.error.URLError, OSError) as e:
        raise PushError(f"{method} {url}: {e}") from None


def _blob(layout: Path, digest: str) -> bytes:
    algo, _, hexdigest = digest.partition(":")
    if algo != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise PushError(f"not a sha256 digest: {digest!r}")
    data = (layout / "blobs" / "sha256" / hexdigest).read_bytes()
    if hashlib.sha256(data).hexdigest() != hexdigest:
        raise PushError(f"blob {digest} does not match its digest")
    return data


def push(layout: Path, ref: str, plain_http: bool) -> str:
    """Push; the manifest's digest."""
    host, _, rest = ref.partition("/")
    repo, _, tag = rest.rpartition(":")
    if not host or not repo or not tag or "/" in tag:
        raise PushError(f"not REGISTRY/REPOSITORY:TAG: {ref!r}")
    base = f"{'http' if plain_http else 'https'}://{host}/v2/{repo}"
    index = json.loads((layout / "index.json").read_text())
    if len(index.get("manifests", [])) != 1:
        raise PushError(f"{layout}/index.json must name one manifest")
    mdesc = index["manifests"][0]
    manifest = _blob(layout, mdesc["digest"])
    parsed = json.loads(manifest)
    # every blob checked against its digest before anything is sent
    blobs = [(desc["digest"], _blob(layout, desc["digest"])) for desc in [parsed["config"], *parsed["layers"]]]
    for digest, data in blobs:
        status, _ = _request("HEAD", f"{base}/blobs/{digest}")
        if status == 200:
            continue
        if status == 401:
            raise PushError(f"{host} asks for credentials; this pusher has none")
        status, headers = _request("POST", f"{base}/blobs/uploads/", b"")
        if status != 202 or "location" not in headers:
            raise PushError(f"starting the upload of {digest}: HTTP {status}")
        location = urllib.parse.urljoin(f"{base}/blobs/uploads/", headers["location"])
        sep = "&" if urllib.parse.urlparse(location).query else "?"
        status, _ = _request("PUT", f"{location}{sep}digest={urllib.parse.quote(digest)}", data,
                             {"Content-Type": "application/octet-stream"})
        if status != 201:
            raise PushError(f"uploading {digest}: HTTP {status}")
    status, headers = _request("PUT", f"{base}/manifests/{tag}", manifest, {"Content-Type": MANIFEST})
    if status != 201:
        raise PushError(f"putting the manifest as {tag}: HTTP {status}")
    return mdesc["digest"]


def main(argv: list[str]) -> int:
    args = [a for a in argv if a != "--plain-http"]
    if len(args) != 2:
        print("usage: oci_push.py LAYOUT_DIR REGISTRY/REPOSITORY:TAG [--plain-http]", file=sys.stderr)
        return 2
    try:
        digest = push(Path(args[0]), args[1], "--plain-http" in argv)
    except (PushError, OSError, ValueError, KeyError) as e:
        print(f"oci_push: {e}", file=sys.stderr)
        return 1
    print(f"{args[1]}@{digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
