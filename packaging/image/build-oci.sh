#!/bin/bash
# The Helm chart's container image (deploy/helm/snapguard: `image`), without docker: a Debian 12
# minbase rootfs (debootstrap from Debian's archive) with the node profile in it (snapguard's Debian
# package and snapguard-criu: packaging/profiles/node.sh), as a one-layer OCI image layout in OUT,
# pushed to a registry over the distribution API where a reference is given:
#   packaging/image/build-oci.sh OUT SNAPGUARD_DEB [SNAPGUARD_CRIU_DEB] [--push REGISTRY/REPO:TAG [--plain-http]]
# As root (debootstrap, chroot). The image's entrypoint is /usr/bin/snapguard; its venv is the one
# the package's postinst built for Debian 12's Python 3.11. The layer's files carry the time of
# SOURCE_DATE_EPOCH (default: the package's mtime). Prints the layout's path (and the pushed
# reference with its digest) on stdout.
set -euo pipefail
PROFILE=build-oci
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=packaging/profiles/lib.sh
. "$here/../profiles/lib.sh"
require_root

push_ref="" plain=()
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --push) push_ref=${2:?--push needs REGISTRY/REPO:TAG}; shift 2 ;;
    --plain-http) plain=(--plain-http); shift ;;
    *) args+=("$1"); shift ;;
  esac
done
[ ${#args[@]} -ge 2 ] && [ ${#args[@]} -le 3 ] ||
  { log "usage: build-oci.sh OUT SNAPGUARD_DEB [SNAPGUARD_CRIU_DEB] [--push REGISTRY/REPO:TAG [--plain-http]]"; exit 2; }
out=$(mkdir -p "${args[0]}" && cd "${args[0]}" && pwd)
deb=$(realpath -e "${args[1]}")
criu_deb=${args[2]:-$(ls -1 "${SNAPGUARD_DEBS:-/var/cache/snapguard-build/debs}"/snapguard-criu_*_amd64.deb 2>/dev/null | sort -V | tail -1)}
[ -n "$criu_deb" ] || { log "no snapguard-criu package (packaging/profiles/criu.sh packs it)"; exit 2; }
criu_deb=$(realpath -e "$criu_deb")
apt_install debootstrap
epoch=${SOURCE_DATE_EPOCH:-$(stat -c %Y "$deb")}

work=$(mktemp -d "${TMPDIR:-/var/tmp}/snapguard-oci.XXXXXX")
root=$work/rootfs
cleanup() {
  umount "$root/proc" 2>/dev/null || true
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT
log "debootstrap bookworm (minbase)"
debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 ||
  { tail -20 "$work/debootstrap.log" >&2; exit 1; }
mkdir -p "$root/tmp/sg"
cp -r "$here/../profiles" "$root/tmp/sg/"
cp "$deb" "$criu_deb" "$root/tmp/sg/"
mount -t proc proc "$root/proc"
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
  bash /tmp/sg/profiles/node.sh "/tmp/sg/${deb##*/}" "/tmp/sg/${criu_deb##*/}"
umount "$root/proc"
# what the image does not need: apt's index and caches, the copies, logs
rm -rf "$root/tmp/sg" "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
  "$root"/var/log/*.log "$root"/var/log/apt/*
find "$root/dev" -mindepth 1 -delete  # the runtime gives the container its /dev

rm -rf "$out/blobs" "$out/index.json" "$out/oci-layout"
mkdir -p "$out/blobs/sha256"
tar --sort=name --numeric-owner --owner=0 --group=0 --mtime="@$epoch" --clamp-mtime --xattrs \
  -C "$root" -cf "$work/layer.tar" .
python3 - "$out" "$work/layer.tar" "$epoch" "$(dpkg-deb -f "$deb" Version)" <<'PY'
import gzip, hashlib, json, os, shutil, sys, time
out, tar, epoch, version = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def blob(data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    with open(os.path.join(out, "blobs", "sha256", digest), "wb") as f:
        f.write(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}
diff_id = hashlib.sha256()
with open(tar, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        diff_id.update(chunk)
gz = tar + ".gz"
with open(tar, "rb") as src, open(gz, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
with open(gz, "rb") as f:
    layer = blob(f.read())
created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
config = {"architecture": "amd64", "os": "linux", "created": created,
          "config": {"Entrypoint": ["/usr/bin/snapguard"], "Cmd": ["--help"],
                     "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
                     "Labels": {"org.opencontainers.image.title": "snapguard",
                                "org.opencontainers.image.version": version}},
          "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id.hexdigest()}"]},
          "history": [{"created": created, "created_by": "packaging/image/build-oci.sh"}]}
cfg = blob(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **cfg},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **layer}]}
man = blob(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
         "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", **man,
                        "platform": {"architecture": "amd64", "os": "linux"},
                        "annotations": {"org.opencontainers.image.ref.name": version}}]}
with open(os.path.join(out, "index.json"), "w") as f:
    json.dump(index, f, indent=2)
with open(os.path.join(out, "oci-layout"), "w") as f:
    json.dump({"imageLayoutVersion": "1.0.0"}, f)
PY
log "OCI layout in $out"
echo "$out"
if [ -n "$push_ref" ]; then
  python3 "$here/oci_push.py" "$out" "$push_ref" "${plain[@]}"
fi
