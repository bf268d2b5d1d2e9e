#!/bin/bash
# The node profile: what a GPU node image needs of snapguard, and nothing of the test rig:
#   packaging/profiles/node.sh SNAPGUARD_DEB [SNAPGUARD_CRIU_DEB]
# as root on the node (or in the image being built). It installs, with apt from the node's own
# suite, snapguard's Debian package (packaging/build-deb.sh: wheels for the node's python3, the
# launcher prebuilt) and CRIU 4.x with its CUDA plugin: the snapguard-criu package that
# packaging/profiles/criu.sh packed on a build host of the node's suite (default: the newest
# snapguard-criu_*.deb in SNAPGUARD_DEBS, /var/cache/snapguard-build/debs). No compiler, no Ceph,
# no registry, no compat stack. Without a snapguard-criu package it stops, unless
# SNAPGUARD_CRIU=debian takes the suite's own criu where it is 4.x (Debian 13's 4.1.1 has no CUDA
# plugin: `snapguard preflight --node` then blocks the gpu capability). runc and containerd are
# the node's own (its distribution's or NVIDIA's), not installed here. Idempotent.
set -euo pipefail
PROFILE=node
# shellcheck source=packaging/profiles/lib.sh
. "$(dirname "$0")/lib.sh"

require_root
[ $# -ge 1 ] && [ $# -le 2 ] || { log "usage: node.sh SNAPGUARD_DEB [SNAPGUARD_CRIU_DEB]"; exit 2; }
snapguard_deb=$(realpath -e "$1") || { log "no such package: $1"; exit 2; }
criu_deb=${2:-}
if [ -z "$criu_deb" ] && [ "${SNAPGUARD_CRIU:-}" != debian ]; then
  criu_deb=$(ls -1 "${SNAPGUARD_DEBS:-/var/cache/snapguard-build/debs}"/snapguard-criu_*_"$(dpkg --print-architecture)".deb 2>/dev/null |
    sort -V | tail -1) || true
  [ -n "$criu_deb" ] || { log "no snapguard-criu package: pass one (packaging/profiles/criu.sh packs it on a build host of this suite), or set SNAPGUARD_CRIU=debian"; exit 2; }
fi

pkgs=("$snapguard_deb")
if [ -n "$criu_deb" ]; then
  criu_deb=$(realpath -e "$criu_deb") || { log "no such package: $criu_deb"; exit 2; }
  pkgs+=("$criu_deb")
else
  apt_update_once
  candidate=$(apt-cache policy criu | sed -n 's/^ *Candidate: //p')
  case $candidate in
    4.*|[5-9].*) pkgs+=(criu) ;;
    *) log "this suite's criu is ${candidate:-absent}, not 4.x: pass a snapguard-criu package"; exit 2 ;;
  esac
fi
apt_update_once
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
log "ready: $(snapguard --version), $( (/usr/local/sbin/criu --version 2>/dev/null || criu --version) | head -1)"
