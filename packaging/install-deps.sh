#!/bin/bash
# Install the real parts snapguard drives, on Debian 12 as root: runc, containerd, iptables and a
# static busybox (the test rootfs) from Debian, and CRIU 4.2.1 with its CUDA plugin built from the
# upstream tarball that Debian's source package points to (Debian 12's CRIU 3.17 cannot run on
# current kernels). Idempotent; a second run only checks.
set -euo pipefail

CRIU_VERSION=4.2.1
CRIU_DEB_VERSION=4.2.1-1
PREFIX=/usr/local
PLUGINDIR=$PREFIX/lib/criu
BUILD_ROOT=${SNAPGUARD_BUILD_ROOT:-/var/cache/snapguard-build}

RUNTIME_PKGS=(runc containerd iptables busybox-static ca-certificates curl xz-utils gcc python3 python3-venv python3-dev)
CRIU_BUILD_PKGS=(build-essential dpkg-dev libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev
  protobuf-compiler libnl-3-dev libnet1-dev libcap-dev libbsd-dev pkg-config python3-protobuf
  libnftables-dev libgnutls28-dev libaio-dev uuid-dev)

log() { printf 'install-deps: %s\n' "$*" >&2; }

[ "$(id -u)" -eq 0 ] || { log "must run as root"; exit 1; }

missing_pkgs() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' || echo "$p"
  done
}

apt_updated=0
apt_install() {
  local want
  want=$(missing_pkgs "$@")
  [ -n "$want" ] || return 0
  if [ $apt_updated -eq 0 ]; then apt-get update -qq; apt_updated=1; fi
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $want >/dev/null
}

criu_ok() {
  [ -x "$PREFIX/sbin/criu" ] && [ -f "$PLUGINDIR/cuda_plugin.so" ] &&
    "$PREFIX/sbin/criu" --version 2>/dev/null | grep -q "Version: $CRIU_VERSION\$"
}

build_criu() {
  apt_install "${CRIU_BUILD_PKGS[@]}"
  local src_list=/etc/apt/sources.list.d/snapguard-unstable-src.sources
  if [ ! -f "$src_list" ]; then
    # Source packages only: nothing from unstable is ever installed.
    cat >"$src_list" <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: unstable
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    apt_updated=0
  fi
  if [ $apt_updated -eq 0 ]; then apt-get update -qq; apt_updated=1; fi
  mkdir -p "$BUILD_ROOT"
  cd "$BUILD_ROOT"
  # apt's signed Sources index gives the .dsc's sha256; the .dsc gives the tarball's.
  local uris dsc_line dsc_url dsc_name dsc_sha orig_name orig_sha orig_url
  uris=$(apt-get source --print-uris -qq "criu=$CRIU_DEB_VERSION")
  dsc_line=$(grep "\.dsc'" <<<"$uris")
  dsc_url=$(awk '{print $1}' <<<"$dsc_line" | tr -d "'")
  dsc_name=$(awk '{print $2}' <<<"$dsc_line")
  dsc_sha=$(awk '{print $4}' <<<"$dsc_line" | sed 's/^SHA256://')
  curl -fsSL -o "$dsc_name" "$dsc_url"
  echo "$dsc_sha  $dsc_name" | sha256sum -c --quiet -
  orig_name="criu_${CRIU_VERSION}.orig.tar.xz"
  orig_sha=$(awk '/^Checksums-Sha256:/{f=1;next} /^[^ ]/{f=0} f && $3=="'"$orig_name"'"{print $1}' "$dsc_name")
  [ -n "$orig_sha" ] || { log "no sha256 for $orig_name in $dsc_name"; exit 1; }
  orig_url="${dsc_url%/*}/$orig_name"
  [ -f "$orig_name" ] || curl -fsSL -o "$orig_name" "$orig_url"
  echo "$orig_sha  $orig_name" | sha256sum -c --quiet - || { rm -f "$orig_name"; log "sha256 mismatch for $orig_name"; exit 1; }
  rm -rf "criu-$CRIU_VERSION"
  tar -xJf "$orig_name"
  cd "criu-$CRIU_VERSION"
  make -s -j"$(nproc)" criu cuda_plugin >build.log 2>&1 || { tail -30 build.log >&2; exit 1; }
  install -D -m 0755 criu/criu "$PREFIX/sbin/criu"
  install -D -m 0644 plugins/cuda/cuda_plugin.so "$PLUGINDIR/cuda_plugin.so"
  log "installed CRIU $CRIU_VERSION to $PREFIX/sbin/criu, CUDA plugin to $PLUGINDIR"
}

apt_install "${RUNTIME_PKGS[@]}"
criu_ok || build_criu
criu_ok || { log "CRIU $CRIU_VERSION not usable after build"; exit 1; }
log "ready: $(runc --version | head -1), containerd $(containerd --version | awk '{print $3}'), criu $CRIU_VERSION"
