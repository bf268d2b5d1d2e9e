#!/bin/bash
# Check the arm64 Debian package on an amd64 machine, as far as it can be without arm64 hardware:
#   packaging/check-arm64.sh [DEB] [OUT]
# DEB (default: built now with packaging/build-deb.sh --arch arm64). The check: the package's
# architecture and its ELF files (the launcher, the C helper in snapguard's wheel) are aarch64, its
# wheels are tagged aarch64 or any; then, under qemu-user-static's emulation (binfmt_misc), a
# Debian 12 arm64 chroot (debootstrap --foreign, then its second stage run emulated) takes the
# package with dpkg (the postinst builds the venv with the chroot's own python3), and
# `snapguard --version`, `snapguard preflight --help`, the C helper's import and the launcher's
# refusal without a pinned file run there. Slow (emulation): not part of the test suite; its
# output goes to OUT/check-arm64.log (default: stdout only). Root. Nothing outside a tmpfs is
# changed, but for the binfmt_misc entry (registered while it runs, where none was).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
log() { printf 'check-arm64: %s\n' "$*" >&2; }
[ "$(id -u)" -eq 0 ] || { log "must run as root"; exit 1; }
deb=${1:-}
out=${2:-}
if [ -n "$out" ]; then
  mkdir -p "$out"
  exec > >(tee "$out/check-arm64.log") 2>&1
fi
MIRROR=${SNAPGUARD_MIRROR:-http://deb.debian.org/debian}
QEMU=/usr/libexec/qemu-binfmt/aarch64-binfmt-P
BINFMT=/proc/sys/fs/binfmt_misc
[ -x "$QEMU" ] || { log "no $QEMU: install qemu-user-static (packaging/profiles/rig.sh does)"; exit 1; }
command -v debootstrap >/dev/null || { log "no debootstrap: install it (packaging/profiles/rig.sh does)"; exit 1; }

work=$(mktemp -d -t snapguard-arm64.XXXXXX)
registered=0
cleanup() {
  set +e
  for m in "$work/root/proc" "$work"; do mountpoint -q "$m" && umount -l "$m"; done
  [ $registered -eq 0 ] || echo -1 >"$BINFMT/qemu-aarch64"
  rmdir "$work" 2>/dev/null
}
trap cleanup EXIT
mount -t tmpfs -o size=6g,mode=0755 snapguard-check-arm64 "$work"

echo "== host: $(uname -m), $(. /etc/os-release && echo "$PRETTY_NAME"), $(dpkg-query -W -f='qemu-user-static ${Version}' qemu-user-static)"
if [ -z "$deb" ]; then
  deb=$(bash "$repo/packaging/build-deb.sh" --arch arm64 "$work/dist")
fi
echo "== package: $(basename "$deb")"
[ "$(dpkg-deb -f "$deb" Architecture)" = arm64 ] || { log "$deb is not Architecture: arm64"; exit 1; }
echo "Depends: $(dpkg-deb -f "$deb" Depends)"
dpkg-deb -x "$deb" "$work/unpacked"
launcher=$work/unpacked/opt/snapguard/venv/share/snapguard/launcher/runc-launcher
echo "launcher: $(readelf -h "$launcher" | sed -n 's/^ *\(Machine\|Type\): *//p' | tr '\n' ' ')"
readelf -h "$launcher" | grep -q 'Machine: *AArch64$'
mkdir "$work/wheel"
python3 -m zipfile -e "$(ls "$work"/unpacked/usr/share/snapguard/wheels/snapguard-*.whl)" "$work/wheel"
echo "C helper: $(readelf -h "$work"/wheel/snapguard/_procscan*.so | sed -n 's/^ *Machine: *//p')"
readelf -h "$work"/wheel/snapguard/_procscan*.so | grep -q 'Machine: *AArch64$'
echo "wheels:"
bad=0
for w in "$work"/unpacked/usr/share/snapguard/wheels/*.whl; do
  name=${w##*/}
  echo "  $name"
  case $name in *-any.whl | *aarch64.whl) ;; *) bad=1 ;; esac
done
[ $bad -eq 0 ] || { log "a wheel is for another machine than aarch64"; exit 1; }

if [ ! -e "$BINFMT/register" ]; then mount -t binfmt_misc binfmt_misc "$BINFMT"; fi
if [ ! -e "$BINFMT/qemu-aarch64" ]; then
  # qemu-user-static's own entry (flag F: the interpreter is opened now, so it runs in the chroot)
  sed -n '1p' /usr/lib/binfmt.d/qemu-aarch64.conf >"$BINFMT/register"
  registered=1
fi
echo "binfmt: $(head -2 "$BINFMT/qemu-aarch64" | tr '\n' ' ')"

root=$work/root
start=$(date +%s)
echo "== debootstrap --foreign --arch=arm64 bookworm (minbase, python3)"
debootstrap --foreign --arch=arm64 --variant=minbase --include=python3 bookworm "$root" "$MIRROR" >"$work/ds1.log" 2>&1 ||
  { tail -20 "$work/ds1.log"; exit 1; }
chroot "$root" /debootstrap/debootstrap --second-stage >"$work/ds2.log" 2>&1 || { tail -20 "$work/ds2.log"; exit 1; }
echo "chroot made in $(($(date +%s) - start)) s; uname -m there: $(chroot "$root" /usr/bin/uname -m)"
mount -t proc proc "$root/proc"
run() { echo "\$ $*"; chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C "$@"; }
cp "$deb" "$root/tmp/"
start=$(date +%s)
run dpkg -i "/tmp/$(basename "$deb")"
echo "dpkg -i took $(($(date +%s) - start)) s (the postinst's venv, emulated)"
run /usr/bin/python3 --version
run /opt/snapguard/venv/bin/python -c 'import platform, sys; print(platform.machine(), sys.version.split()[0])'
run snapguard --version
run snapguard preflight --help
run /opt/snapguard/venv/bin/python -I -c 'import snapguard._procscan, boto3, prometheus_client, grpc; print("imports ok: _procscan, boto3, prometheus_client, grpc")'
# no pinned file here (snapguard install was not run): the launcher's one-line refusal, exit 2
set +e
run /opt/snapguard/venv/share/snapguard/launcher/runc-launcher --version
rc=$?
set -e
[ $rc -eq 2 ] || { log "the launcher exited $rc, not 2"; exit 1; }
echo "== ok: the arm64 package installs and runs under emulation"
