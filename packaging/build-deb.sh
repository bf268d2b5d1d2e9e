#!/bin/bash
# Build snapguard's Debian package (dh-virtualenv, from Debian) into OUT (default dist/):
#   packaging/build-deb.sh [OUT]
# The wheel is built from this repository (SNAPGUARD_WHEEL names a prebuilt one instead), then
# dh-virtualenv makes /opt/snapguard/venv with it and its dependencies (pip, from the package
# index) and dpkg-buildpackage packs the venv, the /usr/bin links, /etc/snapguard/config.toml (a
# conffile) and snapguard-preflight.service. Installs its build tools with apt where missing (root).
# Prints the .deb's path on stdout.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:-$repo/dist}" && cd "${1:-$repo/dist}" && pwd)
log() { printf 'build-deb: %s\n' "$*" >&2; }

need=()
for p in debhelper dh-virtualenv python3-venv; do
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
# /etc/snapguard/config.toml as the table of keys renders it (snapguard/config/keys.py)
PYTHONPATH=$repo "${SNAPGUARD_PYTHON:-python3}" -m snapguard.config template >"$src/debian/config.toml"
cp "$repo/README.md" "$src/"
# dh-virtualenv installs these requirements into the venv: the wheel with its `metrics` extra
echo "./dist/$wheel[metrics]" >"$src/requirements.txt"
deb_version=$(dpkg-parsechangelog -l "$src/debian/changelog" -S Version)
[ "$deb_version" = "$version" ] || { log "debian/changelog says $deb_version, pyproject.toml $version"; exit 1; }

log "dpkg-buildpackage (dh-virtualenv: /opt/snapguard/venv)"
if ! (cd "$src" && dpkg-buildpackage -b -us -uc >"$work/build.log" 2>&1); then
  tail -40 "$work/build.log" >&2
  exit 1
fi
deb=$(ls "$work"/snapguard_"$version"_*.deb)
cp "$deb" "$out/"
echo "$out/$(basename "$deb")"
