#!/bin/bash
# Build snapguard's Debian package into OUT (default dist/):
#   packaging/build-deb.sh [--arch amd64|arm64] [OUT]
# The package carries wheels, not a venv (a venv is tied to the Python it was made with): the wheel
# built from this repository (SNAPGUARD_WHEEL names a prebuilt one instead), its dependencies with
# the `s3`, `metrics` and `k8s` extras for CPython 3.10, 3.11, 3.12 and 3.13 (manylinux, from the package index),
# and pip's own wheel; its postinst builds /opt/snapguard/venv from them for the node's python3,
# offline. snapguard-runc's C launcher is compiled here, for /etc/snapguard/config.toml, with the
# pinned compiler (`snapguard install` installs it; no compiler on the node). dpkg-buildpackage packs
# them with the /usr/bin links, /etc/snapguard/config.toml (a conffile) and the units (preflight and
# spill enabled; the agent installed only).
# --arch (default: this machine's, amd64 or arm64) picks the package's architecture. Another than
# this machine's is a cross build with Debian's cross compiler (gcc-aarch64-linux-gnu or
# gcc-x86-64-linux-gnu): the launcher, and snapguard's wheel with its C helper (packaging/
# build-wheel.sh, through the target's sysconfig: Debian's libpython3.X-dev:ARCH, multiarch), the
# other wheels downloaded for the target (packaging/marker_deps.py adds what pip leaves out).
# Installs its build tools with apt where missing (root; for a cross build that adds the target
# architecture to dpkg). Prints the .deb's path on stdout.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
log() { printf 'build-deb: %s\n' "$*" >&2; }
usage() { sed -n '2,3p' "$0" | sed 's/^# *//' >&2; }

. "$repo/packaging/arch-args.sh"
parse_arch_args "$@"
out=$(mkdir -p "${out_arg:-$repo/dist}" && cd "${out_arg:-$repo/dist}" && pwd)
host_arch=$(dpkg --print-architecture)
cross=0
[ "$arch" = "$host_arch" ] || cross=1
# the Python whose sysconfig builds the cross wheel (the target's is Debian's, for this X.Y)
host_py=/usr/bin/python3
pyver=$("$host_py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

need=(debhelper gcc libc6-dev)
if [ $cross -eq 1 ]; then
  cross_gcc=${gnu//_/-}  # Debian names the package gcc-x86-64-linux-gnu, the compiler x86_64-linux-gnu-gcc
  need+=("gcc-$cross_gcc" "libc6-dev:$arch" "libpython$pyver-dev:$arch")
fi
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" -eq 0 ] || { log "missing build tools: ${missing[*]} (run as root to install them)"; exit 1; }
  if [ $cross -eq 1 ] && ! dpkg --print-foreign-architectures | grep -qx "$arch"; then
    log "adding the $arch architecture to dpkg (the cross build's headers and libc)"
    dpkg --add-architecture "$arch"
  fi
  log "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
cc=/usr/bin/cc  # options.DEFAULT_CC
[ $cross -eq 0 ] || cc=/usr/bin/$gnu-gcc

work=$(mktemp -d -t snapguard-deb.XXXXXX)
trap 'rm -rf "$work"' EXIT
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/pyproject.toml" | head -1)
src=$work/snapguard-$version
mkdir -p "$src/dist"

# the wheel (packaging/build-wheel.sh: its C helper checked to be for the package's machine)
if [ -n "${SNAPGUARD_WHEEL:-}" ]; then
  cp "$SNAPGUARD_WHEEL" "$src/dist/"
else
  bash "$repo/packaging/build-wheel.sh" --arch "$arch" "$src/dist" >/dev/null
fi
wheel=$(cd "$src/dist" && ls snapguard-*.whl)
case $wheel in *-abi3-linux_"$machine".whl) ;; *) log "$wheel is not tagged abi3 for linux_$machine"; exit 1 ;; esac

cp -r "$repo/packaging/debian" "$src/debian"
# the agent's unit, as packaging/systemd has it
cp "$repo/packaging/systemd/snapguard-agent.service" "$src/debian/snapguard.snapguard-agent.service"
# /etc/snapguard/config.toml as the table of keys renders it (snapguard/config/keys.py)
PYTHONPATH=$repo "${SNAPGUARD_PYTHON:-python3}" -m snapguard.config template >"$src/debian/config.toml"
# bash's completion for snapguard (bash-completion loads it on the first <TAB> after `snapguard`)
mkdir -p "$src/completion"
PYTHONPATH=$repo "${SNAPGUARD_PYTHON:-python3}" -m snapguard.cli completion bash >"$src/completion/snapguard"
# zsh's: a #compdef file in Debian's vendor-completions directory, which compinit reads
mkdir -p "$src/completion/zsh"
PYTHONPATH=$repo "${SNAPGUARD_PYTHON:-python3}" -m snapguard.cli completion zsh --autoload >"$src/completion/zsh/_snapguard"
cp "$repo/README.md" "$src/"
# the wheelhouse: snapguard's wheel, its dependencies for each CPython the package serves, pip
py=${SNAPGUARD_PYTHON:-$repo/.venv/bin/python}
[ -x "$py" ] || py=python3
mkdir -p "$src/wheels"
cp "$src/dist/$wheel" "$src/wheels/"
download() {  # download VERSION REQUIREMENT...: wheels for CPython VERSION on the package's machine
  local v=$1
  shift
  "$py" -m pip download -q --disable-pip-version-check --no-input --only-binary=:all: -d "$src/wheels" \
    --implementation cp --python-version "$v" --abi "cp${v/./}" --abi abi3 --abi none \
    --platform "linux_$machine" --platform "manylinux_2_28_$machine" --platform "manylinux_2_17_$machine" \
    --platform "manylinux2014_$machine" "$@" >&2 || { log "pip download for CPython $v on $arch failed"; exit 1; }
}
for v in 3.10 3.11 3.12 3.13; do
  download "$v" "$src/dist/$wheel[s3,metrics,k8s]" pip
  # what pip left out for v: requirements under a python_version marker (marker_deps.py says why)
  for _ in 1 2 3 4 5; do
    more=$("$py" "$repo/packaging/marker_deps.py" "$src/wheels" "$v" s3 metrics k8s)
    [ -n "$more" ] || break
    log "CPython $v also needs: $(echo $more)"
    mapfile -t reqs <<<"$more"
    download "$v" "${reqs[@]}"
  done
  [ -z "$more" ] || { log "CPython $v: requirements still missing: $more"; exit 1; }
done
# every wheel is for the package's machine or for any
for w in "$src"/wheels/*.whl; do
  case ${w##*/} in *-any.whl | *_"$machine".whl | *."$machine".whl) ;; *) log "${w##*/} is not for $arch"; exit 1 ;; esac
done
# snapguard-runc's launcher for the package's config path, built as `snapguard install` builds it
mkdir -p "$src/launcher"
PYTHONPATH=$repo "$py" - "$src/launcher" "$cc" <<'PY'
import os, sys
from snapguard.install import DEFAULT_SNAPGUARD_CONFIG, build_launcher
out, cc = sys.argv[1:3]
with open(os.path.join(out, "runc-launcher"), "wb") as f:
    f.write(build_launcher(DEFAULT_SNAPGUARD_CONFIG, cc=cc))
os.chmod(os.path.join(out, "runc-launcher"), 0o755)
with open(os.path.join(out, "config-path"), "w") as f:
    f.write(DEFAULT_SNAPGUARD_CONFIG + "\n")
PY
readelf -h "$src/launcher/runc-launcher" | grep -q "Machine: *$elf_machine\$" ||
  { log "the launcher is not built for $arch"; exit 1; }
deb_version=$(dpkg-parsechangelog -l "$src/debian/changelog" -S Version)
[ "$deb_version" = "$version" ] || { log "debian/changelog says $deb_version, pyproject.toml $version"; exit 1; }

log "dpkg-buildpackage for $arch"
if ! (cd "$src" && dpkg-buildpackage -b -a"$arch" -us -uc >"$work/build.log" 2>&1); then
  tail -40 "$work/build.log" >&2
  exit 1
fi
deb=$(ls "$work"/snapguard_"$version"_"$arch".deb)
cp "$deb" "$out/"
echo "$out/$(basename "$deb")"
