#!/bin/bash
# The test rig's profile (packaging/setup.sh runs it; packaging/install-deps.sh is its old name), on
# Debian 12 as root: what the tests start for real. runc, containerd, iptables and a static busybox
# (the test rootfs) from Debian, docker-registry (the kubelet-path test's base images), Ceph's
# radosgw on a one-node cluster (the S3 store tests), CRIU 4.2.1 with its CUDA plugin (criu.sh:
# built from source, and packed as snapguard-criu for the node profile), and the compat stack:
# Debian unstable's containerd and runc, unpacked under /opt/snapguard/compat (never installed
# system-wide; see install_compat). A node needs none of it but CRIU: packaging/profiles/node.sh.
# Idempotent; a second run only checks.
set -euo pipefail
PROFILE=rig
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=packaging/profiles/lib.sh
. "$here/lib.sh"

CRIU_VERSION=4.2.1
BUILD_ROOT=${SNAPGUARD_BUILD_ROOT:-/var/cache/snapguard-build}

# The compat stack (DESIGN.md, "Runtimes and versions the executor meets"): containerd 2.x and
# runc 1.3 from Debian unstable, exactly these package versions. containerd's binaries need only
# glibc 2.34 and run on Debian 12 as they are; unstable's runc needs glibc 2.38, so unstable's libc6
# and libseccomp2 are unpacked beside it and its ELF interpreter and rpath point at them.
# When unstable has moved past these versions, SNAPGUARD_COMPAT_MIRROR=http://snapshot.debian.org/
# archive/debian/<YYYYMMDDTHHMMSSZ> names a day that had them (same archive key).
COMPAT=/opt/snapguard/compat
COMPAT_MIRROR=${SNAPGUARD_COMPAT_MIRROR:-http://deb.debian.org/debian}
COMPAT_PKGS=(containerd=2.1.9+ds1-5 runc=1.3.6+ds1-1 libc6=2.43-7 libseccomp2=2.6.1-1+b2)
COMPAT_CONTAINERD_VERSION=2.1.9
COMPAT_RUNC_VERSION=1.3.6

# docker-registry: the registry the kubelet-path test's restore pulls the checkpoint's base image from
RUNTIME_PKGS=(runc containerd iptables busybox-static ca-certificates curl xz-utils gcc python3 python3-venv python3-dev
  docker-registry)
# A real S3 server for the image-store tests: Ceph's radosgw on a one-node cluster (memstore OSD)
STORE_PKGS=(ceph-mon ceph-osd radosgw ceph-common)
# the package and profile tests (tests/system/test_deb.py): Debian chroots, the .deb's build
PACKAGING_PKGS=(debootstrap debhelper dpkg-dev)
# the zsh completion test (tests/unit/test_completion_zsh.py)
SHELL_PKGS=(zsh)
# the arm64 package (packaging/build-deb.sh --arch arm64) and its check under emulation
# (packaging/check-arm64.sh): Debian's aarch64 cross compiler and libc, qemu-user-static, and from
# the arm64 architecture (multiarch) the libc and python3's headers the cross build compiles against
CROSS_PKGS=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static)
# (apt moves the host's python3.X and libraries to the same versions as their :arm64 twins: multiarch)

require_root

# The compat stack is in place: the pinned packages (its PACKAGES record), every file as installed
# (SHA256SUMS), runc and containerd answer with their versions (runc only runs through the
# unpacked glibc: Debian 12's is 2.36), runc's interpreter and rpath are the compat ones, and
# nothing in it is writable but by root.
compat_ok() {
  [ -f "$COMPAT/PACKAGES" ] &&
    [ "$(awk '{print $1 "=" $2}' "$COMPAT/PACKAGES")" = "$(printf '%s\n' "${COMPAT_PKGS[@]}")" ] &&
    [ -x "$COMPAT/bin/containerd-shim-runc-v2" ] && [ -x "$COMPAT/bin/ctr" ] &&
    [ "$(patchelf --print-interpreter "$COMPAT/bin/runc" 2>/dev/null)" = "$COMPAT/lib/ld-linux-x86-64.so.2" ] &&
    [ "$(patchelf --print-rpath "$COMPAT/bin/runc" 2>/dev/null)" = "$COMPAT/lib" ] &&
    [[ "$("$COMPAT/bin/runc" --version 2>/dev/null)" == "runc version $COMPAT_RUNC_VERSION+"* ]] &&
    [[ "$("$COMPAT/bin/containerd" --version 2>/dev/null)" == *" $COMPAT_CONTAINERD_VERSION+"* ]] &&
    (cd "$COMPAT" && sha256sum --quiet --strict -c SHA256SUMS >/dev/null 2>&1) &&
    [ -z "$(find "$COMPAT" \( ! -user root -o -perm /022 \) ! -type l -print -quit)" ] &&
    [ -z "$(find /opt/snapguard /opt -maxdepth 0 \( ! -user root -o -perm /022 \) -print)" ]
}

install_compat() {
  # A private apt configuration that knows unstable's binary index and nothing else: its own
  # sources file, lists and caches under $BUILD_ROOT, no sources.list.d, no preferences. The
  # system's apt never sees unstable, and nothing from it is installed: the packages are only
  # downloaded (checked by apt against the signed InRelease, and again below) and unpacked.
  local apt_dir=$BUILD_ROOT/unstable-apt
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/empty.d"
  local valid=""
  case "$COMPAT_MIRROR" in *snapshot.debian.org*) valid="Check-Valid-Until: no" ;; esac
  cat >"$apt_dir/unstable.sources" <<SRC
Types: deb
URIs: $COMPAT_MIRROR
Suites: unstable
Components: main
Architectures: amd64
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
$valid
SRC
  local apt=(apt-get -qq -o "Dir::Etc::sourcelist=$apt_dir/unstable.sources"
    -o "Dir::Etc::sourceparts=$apt_dir/empty.d" -o "Dir::Etc::preferences=$apt_dir/empty.d/none"
    -o "Dir::Etc::preferencesparts=$apt_dir/empty.d" -o "Dir::State::Lists=$apt_dir/lists"
    -o "Dir::Cache=$apt_dir/cache" -o APT::Architectures=amd64 -o Acquire::Languages=none)
  "${apt[@]}" update
  local uris
  uris=$("${apt[@]}" download --print-uris "${COMPAT_PKGS[@]}") || {
    log "unstable's index lacks one of ${COMPAT_PKGS[*]}; set SNAPGUARD_COMPAT_MIRROR to a snapshot.debian.org day that has them"
    exit 1
  }
  local dl=$apt_dir/debs
  rm -rf "$dl"
  mkdir -p "$dl"
  chown _apt:root "$dl"  # apt downloads as _apt (its sandbox user)
  (cd "$dl" && "${apt[@]}" download "${COMPAT_PKGS[@]}")
  # Each .deb against the SHA256 the signed index gives (printed by --print-uris).
  local name sha
  while read -r _ name _ sha; do
    echo "${sha#SHA256:}  $dl/$name" | sha256sum -c --quiet - || { log "sha256 mismatch for $name"; exit 1; }
  done <<<"$uris"
  local stage
  stage=$(mktemp -d "$BUILD_ROOT/compat-stage.XXXXXX")
  local deb
  for deb in "$dl"/*.deb; do dpkg-deb -x "$deb" "$stage/root"; done
  local new=$stage/compat gnu=$stage/root/usr/lib/x86_64-linux-gnu
  install -d -m 0755 "$new/bin" "$new/lib"
  install -m 0755 "$stage/root/usr/bin/containerd" "$stage/root/usr/bin/containerd-shim-runc-v2" \
    "$stage/root/usr/bin/ctr" "$stage/root/usr/sbin/runc" "$new/bin/"
  # libc6's shared objects (libc, the loader, the NSS modules it may dlopen) and libseccomp;
  # links resolved to files, so the directory holds plain files only.
  local f
  for f in "$gnu"/*.so*; do install -m 0755 "$(readlink -f "$f")" "$new/lib/${f##*/}"; done
  # DT_RPATH (not RUNPATH): searched before LD_LIBRARY_PATH, which containerd's environment may set.
  patchelf --set-interpreter "$COMPAT/lib/ld-linux-x86-64.so.2" --force-rpath --set-rpath "$COMPAT/lib" "$new/bin/runc"
  # What is in it: package, version, the index's sha256 of the .deb, the file (compat_ok reads it).
  : >"$new/PACKAGES"
  local spec
  for spec in "${COMPAT_PKGS[@]}"; do
    while read -r _ name _ sha; do
      case "$name" in "${spec%%=*}_"*) printf '%s %s %s %s\n' "${spec%%=*}" "${spec#*=}" "${sha#SHA256:}" "$name" >>"$new/PACKAGES" ;; esac
    done <<<"$uris"
  done
  # What was installed, byte for byte (runc as patched), for compat_ok to check on every run.
  (cd "$new" && find bin lib -type f -print0 | sort -z | xargs -0 sha256sum) >"$new/SHA256SUMS"
  chmod 0644 "$new/PACKAGES" "$new/SHA256SUMS"
  chown -R root:root "$new"
  chmod 0755 "$new"
  install -d -m 0755 -o root -g root /opt/snapguard
  chmod go-w /opt/snapguard
  rm -rf "$COMPAT.old"
  [ ! -e "$COMPAT" ] || mv "$COMPAT" "$COMPAT.old"
  mv "$new" "$COMPAT"
  rm -rf "$COMPAT.old" "$stage" "$dl"
  log "installed the compat stack to $COMPAT: ${COMPAT_PKGS[*]}"
}

apt_install "${RUNTIME_PKGS[@]}"
apt_install "${STORE_PKGS[@]}"
apt_install "${PACKAGING_PKGS[@]}"
apt_install "${SHELL_PKGS[@]}"
apt_install "${CROSS_PKGS[@]}"
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  dpkg --add-architecture arm64
  apt_updated=0  # arm64's index is not in the lists yet
fi
apt_install libc6-dev:arm64 "libpython$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')-dev:arm64"
bash "$here/criu.sh" >/dev/null
apt_install patchelf
compat_ok || install_compat
compat_ok || { log "the compat stack in $COMPAT is not usable after install"; exit 1; }
log "ready: $(runc --version | head -1), containerd $(containerd --version | awk '{print $3}'), criu $CRIU_VERSION;" \
  "compat: $("$COMPAT/bin/runc" --version | head -1), containerd $("$COMPAT/bin/containerd" --version | awk '{print $3}')"
