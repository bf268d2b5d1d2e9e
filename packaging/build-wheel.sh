#!/bin/bash
# Build snapguard's wheel, its C helper (snapguard._procscan, for CPython's stable ABI) compiled for
# ARCH, into OUT; prints the wheel's path:
#   packaging/build-wheel.sh [--arch amd64|arm64] OUT
# ARCH (default: this machine's) other than this machine's is a cross build, as Debian cross-builds
# Python extensions: the target's sysconfig (Debian's libpython3.X-dev:ARCH, multiarch) gives the
# compiler (Debian's gcc-aarch64-linux-gnu or gcc-x86-64-linux-gnu), the linker and the platform
# tag. The wheel is built from a copy of the product's sources (an in-tree build would reuse what
# an earlier one left in build/) with SNAPGUARD_PYTHON (default .venv/bin/python), and refused
# unless it is tagged abi3 for ARCH and carries the helper built for ARCH (setup.py would go on
# without it). packaging/build-deb.sh builds its wheel with this.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
log() { printf 'build-wheel: %s\n' "$*" >&2; }
usage() { sed -n '4p' "$0" | sed 's/^# *//' >&2; }

. "$repo/packaging/arch-args.sh"
parse_arch_args "$@"
out=$out_arg
[ -n "$out" ] || { usage; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)

py=${SNAPGUARD_PYTHON:-$repo/.venv/bin/python}
[ -x "$py" ] || py=python3
isolation=()
# the build tools already there: no download
if "$py" -c 'import cffi, setuptools; assert int(setuptools.__version__.split(".")[0]) >= 77' 2>/dev/null; then
  isolation=(--no-build-isolation)
fi
work=$(mktemp -d -t snapguard-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src" "$work/dist"
tar -C "$repo" --exclude=__pycache__ --exclude='*.so' --exclude=_build --exclude='*.egg-info' \
  -cf - pyproject.toml setup.py README.md snapguard c_helpers | tar -C "$work/src" -xf -

cross_env=()
if [ "$arch" != "$(dpkg --print-architecture)" ]; then
  # the target's sysconfig, for the X.Y of Debian's python3; the module alone on PYTHONPATH, so
  # that nothing else of Debian's stdlib mixes in
  pyver=$(/usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  sysconfig_name=_sysconfigdata__linux_$gnu
  [ -f "/usr/lib/python$pyver/$sysconfig_name.py" ] ||
    { log "no /usr/lib/python$pyver/$sysconfig_name.py: install libpython$pyver-dev:$arch"; exit 1; }
  [ -x "/usr/bin/$gnu-gcc" ] || { log "no /usr/bin/$gnu-gcc: install gcc-${gnu//_/-}"; exit 1; }
  mkdir "$work/sysconfig"
  cp "/usr/lib/python$pyver/$sysconfig_name.py" "$work/sysconfig/"
  cross_env=(PYTHONPATH="$work/sysconfig" _PYTHON_SYSCONFIGDATA_NAME="$sysconfig_name"
    _PYTHON_HOST_PLATFORM="linux-$machine" PATH=/usr/sbin:/usr/bin:/sbin:/bin)
fi
log "building the wheel with $py for $arch"
env "${cross_env[@]}" "$py" -m pip wheel -q --disable-pip-version-check --no-deps "${isolation[@]}" \
  -w "$work/dist" "$work/src" >&2

wheel=$(cd "$work/dist" && ls snapguard-*.whl)
case $wheel in *-abi3-linux_"$machine".whl) ;; *) log "$wheel is not tagged abi3 for linux_$machine"; exit 1 ;; esac
python3 -m zipfile -e "$work/dist/$wheel" "$work/unpacked"
helper=$(ls "$work"/unpacked/snapguard/_procscan*.so 2>/dev/null | head -1)
[ -n "$helper" ] || { log "$wheel has no C helper (snapguard/_procscan*.so): see the build's output"; exit 1; }
readelf -h "$helper" | grep -q "Machine: *$elf_machine\$" || { log "$wheel's C helper is not built for $arch"; exit 1; }
cp "$work/dist/$wheel" "$out/"
echo "$out/$wheel"
