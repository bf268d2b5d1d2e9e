#!/bin/bash
# CRIU 4.2.1 with its CUDA plugin, for the test rig and for nodes: built here (a build host: it
# installs a compiler and CRIU's build dependencies) from the upstream tarball that Debian's source
# package points to (Debian 12's CRIU 3.17 cannot run on current kernels; Debian 13's 4.1.1 has no
# CUDA plugin), installed to /usr/local, and packed as the binary package snapguard-criu
# (DEBS/snapguard-criu_4.2.1-1_ARCH.deb, its dependencies the shared libraries it links, from the
# suite it was built on) that the node profile installs with no compiler. Run it on the suite the
# nodes run (Debian 12 here; the same script on a Debian 13 host or chroot makes Debian 13's).
# Idempotent: an installed CRIU of this version is packed as it is, a package of it already packed
# stays.
# Prints the package's path on stdout.
set -euo pipefail
PROFILE=criu
# shellcheck source=packaging/profiles/lib.sh
. "$(dirname "$0")/lib.sh"

CRIU_VERSION=4.2.1
CRIU_DEB_VERSION=4.2.1-1
PREFIX=/usr/local
PLUGINDIR=$PREFIX/lib/criu
BUILD_ROOT=${SNAPGUARD_BUILD_ROOT:-/var/cache/snapguard-build}
DEBS=${SNAPGUARD_DEBS:-$BUILD_ROOT/debs}
CRIU_BUILD_PKGS=(build-essential dpkg-dev libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev
  protobuf-compiler libnl-3-dev libnet1-dev libcap-dev libbsd-dev pkg-config python3-protobuf
  libnftables-dev libgnutls28-dev libaio-dev uuid-dev curl xz-utils ca-certificates)

require_root

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
  apt_update_once
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

# The installed CRIU and plugin as snapguard-criu: its Depends are what dpkg-shlibdeps finds for
# the two ELF files on this suite.
pack_criu() {
  local deb=$1 stage deps
  apt_install dpkg-dev
  stage=$(mktemp -d "${TMPDIR:-/tmp}/snapguard-criu.XXXXXX")
  install -D -m 0755 "$PREFIX/sbin/criu" "$stage/root$PREFIX/sbin/criu"
  install -D -m 0644 "$PLUGINDIR/cuda_plugin.so" "$stage/root$PLUGINDIR/cuda_plugin.so"
  mkdir -p "$stage/debian" "$stage/root/DEBIAN"
  printf 'Source: snapguard-criu\n\nPackage: snapguard-criu\nArchitecture: any\n' >"$stage/debian/control"
  deps=$(cd "$stage" && dpkg-shlibdeps -O "-eroot$PREFIX/sbin/criu" "-eroot$PLUGINDIR/cuda_plugin.so" 2>/dev/null |
    sed -n 's/^shlibs:Depends=//p')
  [ -n "$deps" ] || { log "dpkg-shlibdeps found no dependencies for $PREFIX/sbin/criu"; exit 1; }
  cat >"$stage/root/DEBIAN/control" <<CTL
Package: snapguard-criu
Version: $CRIU_DEB_VERSION
Architecture: $(dpkg --print-architecture)
Maintainer: snapguard maintainers <snapguard@localhost>
Depends: $deps
Section: admin
Priority: optional
Homepage: https://criu.org
Description: CRIU $CRIU_VERSION with its CUDA plugin, for snapguard
 CRIU (checkpoint/restore in userspace) built from the upstream release that
 Debian's criu $CRIU_DEB_VERSION source package carries, with the CUDA plugin
 (cuda_plugin.so), installed as $PREFIX/sbin/criu and $PLUGINDIR: the paths
 snapguard's config names by default.
CTL
  mkdir -p "$DEBS"
  dpkg-deb --root-owner-group -Zxz --build "$stage/root" "$deb.tmp" >/dev/null
  mv "$deb.tmp" "$deb"
  rm -rf "$stage"
  log "packed $deb"
}

criu_ok || build_criu
criu_ok || { log "CRIU $CRIU_VERSION not usable after build"; exit 1; }
deb=$DEBS/snapguard-criu_${CRIU_DEB_VERSION}_$(dpkg --print-architecture).deb
# packed already: this version, and the criu in it is the one installed
packed_ok() {
  [ -f "$deb" ] && [ "$(dpkg-deb -f "$deb" Version 2>/dev/null)" = "$CRIU_DEB_VERSION" ] &&
    [ "$(dpkg-deb --fsys-tarfile "$deb" | tar -xOf - ".$PREFIX/sbin/criu" | sha256sum)" = "$(sha256sum <"$PREFIX/sbin/criu")" ]
}
packed_ok || pack_criu "$deb"
echo "$deb"
