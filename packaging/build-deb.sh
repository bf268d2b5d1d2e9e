#!/bin/bash
# Build snapguard's Debian package into OUT (default dist/):
#   packaging/build-deb.sh [OUT]
# The package carries wheels, not a venv (a venv is tied to the Python it was made with): the wheel
# built from this repository (SNAPGUARD_WHEEL names a prebuilt one instead), its dependencies with
# the `s3`, `metrics` and `k8s` extras for CPython 3.10, 3.11, 3.12 and 3.13 (manylinux, from the package index),
# and pip's own wheel; its postinst builds /opt/snapguard/venv from them for the node's python3,
# offline. snapguard-runc's C launcher is compiled here, for /etc/snapguard/config.toml, with the
# pinned compiler (`snapguard install` installs it; no compiler on the node). dpkg-buildpackage packs
# them with the /usr/bin links, /etc/snapguard/config.toml (a conffile) and the units (preflight and
# spill enabled; the agent installed only). amd64 only. Installs its build tools with apt where
# missing (root). Prints the .deb's path on stdout.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:-$repo/dist}" && cd "${1:-$repo/dist}" && pwd)
log() { printf 'build-deb: %s\n' "$*" >&2; }

need=()
for p in debhelper gcc libc6-dev; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  [ "$(id -u)" -eq 0 ] || { log "missing build tools: ${need[*]} (run as root to install them)"; exit 1; }
  log "installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

work=$(mktemp -d -t snapguard-deb.XXXXXX)
trap 'rm -rf "$work"' EXIT
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/pyproject.toml" | head -1)
src=$work/snapguard-$version
mkdir -p "$src/dist"

# the wheel, built from a copy of the product's sources (an in-tree build would reuse whatever an
# earlier one left in build/)
if [ -n "${SNAPGUARD_WHEEL:-}" ]; then
  cp "$SNAPGUARD_WHEEL" "$src/dist/"
else
  py=${SNAPGUARD_PYTHON:-$repo/.venv/bin/python}
  [ -x "$py" ] || py=python3
  isolation=()
  # the build tools already there: no download
  if "$py" -c 'import cffi, setuptools; assert int(setuptools.__version__.split(".")[0]) >= 77' 2>/dev/null; then
    isolation=(--no-build-isolation)
  fi
  mkdir -p "$work/wheel-src"
  tar -C "$repo" --exclude=__pycache__ --exclude='*.so' --exclude=_build --exclude='*.egg-info' \
    -cf - pyproject.toml setup.py README.md snapguard c_helpers | tar -C "$work/wheel-src" -xf -
  log "building the wheel with $py"
  "$py" -m pip wheel -q --disable-pip-version-check --no-deps "${isolation[@]}" -w "$src/dist" "$work/wheel-src" >&2
fi
wheel=$(cd "$src/dist" && ls snapguard-*.whl)
case $wheel in *-abi3-*) ;; *) log "$wheel is not tagged abi3"; exit 1 ;; esac

cp -r "$repo/packaging/debian" "$src/debian"
# the agent's unit, as packaging/systemd has it
cp "$repo/packaging/systemd/snapguard-agent.service" "$src/debian/snapguard.snapguard-agent.service"
# /etc/snapguard/config.toml as the table of keys renders it (snapguard/config/keys.py)
PYTHONPATH=$repo "${SNAPGUARD_PYTHON:-python3}" -m snapguard.config template >"$src/debian/config.toml"
cp "$repo/README.md" "$src/"
# the wheelhouse: snapguard's wheel, its dependencies for each CPython the package serves, pip
py=${SNAPGUARD_PYTHON:-$repo/.venv/bin/python}
[ -x "$py" ] || py=python3
mkdir -p "$src/wheels"
cp "$src/dist/$wheel" "$src/wheels/"
for v in 3.10 3.11 3.12 3.13; do
  "$py" -m pip download -q --disable-pip-version-check --no-input --only-binary=:all: -d "$src/wheels" \
    --implementation cp --python-version "$v" --abi "cp${v/./}" --abi abi3 --abi none \
    --platform linux_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "$src/dist/$wheel[s3,metrics,k8s]" pip >&2 || { log "pip download for CPython $v failed"; exit 1; }
done
# snapguard-runc's launcher for the package's config path, built as `snapguard install` builds it
mkdir -p "$src/launcher"
PYTHONPATH=$repo "$py" - "$src/launcher" <<'PY'
import os, sys
from snapguard.install import DEFAULT_SNAPGUARD_CONFIG, build_launcher
out = sys.argv[1]
with open(os.path.join(out, "runc-launcher"), "wb") as f:
    f.write(build_launcher(DEFAULT_SNAPGUARD_CONFIG))
os.chmod(os.path.join(out, "runc-launcher"), 0o755)
with open(os.path.join(out, "config-path"), "w") as f:
    f.write(DEFAULT_SNAPGUARD_CONFIG + "\n")
PY
deb_version=$(dpkg-parsechangelog -l "$src/debian/changelog" -S Version)
[ "$deb_version" = "$version" ] || { log "debian/changelog says $deb_version, pyproject.toml $version"; exit 1; }

log "dpkg-buildpackage"
if ! (cd "$src" && dpkg-buildpackage -b -us -uc >"$work/build.log" 2>&1); then
  tail -40 "$work/build.log" >&2
  exit 1
fi
deb=$(ls "$work"/snapguard_"$version"_*.deb)
cp "$deb" "$out/"
echo "$out/$(basename "$deb")"
