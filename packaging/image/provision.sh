#!/bin/bash
# Node-image bake: install snapguard on the image being built and gate the bake on the
# capabilities the image is meant to have. Run as root by the image builder, e.g. from Packer:
#
#   provisioner "file"  { source = "./snapguard" destination = "/tmp/snapguard" }
#   provisioner "shell" {
#     execute_command = "sudo -E bash '{{ .Path }}'"
#     environment_vars = ["SNAPGUARD_SRC=/tmp/snapguard", "SNAPGUARD_IMAGE_CAPABILITIES=host-netns-containers,gpu"]
#     script = "./snapguard/packaging/image/provision.sh"
#   }
#
# or from cloud-init (runcmd: [[bash, /opt/snapguard-src/packaging/image/provision.sh]]).
#
# Settings (environment):
#   SNAPGUARD_SRC                 the snapguard source tree (default: the one holding this script)
#   SNAPGUARD_PREFIX              the root-owned virtual environment to install into (/opt/snapguard)
#   SNAPGUARD_IMAGE_CAPABILITIES  what the image must be able to snapshot, for `snapguard preflight
#                                 --node --require` (default: snapguard's, host-netns-containers and,
#                                 where the builder has an NVIDIA driver, gpu). Bake a GPU image on a
#                                 builder with the GPU and its driver loaded: the gpu capability is
#                                 checked against the driver that is running.
#   SNAPGUARD_REPORT_DIR          where the gate's reports stay in the image (/var/log/snapguard)
#
# A blocked capability fails the bake (exit 1), as does a gate that could not check (exit 2); the
# JUnit and JSON reports are in SNAPGUARD_REPORT_DIR either way, for the builder to collect.
set -euo pipefail

src=${SNAPGUARD_SRC:-$(cd "$(dirname "$0")/../.." && pwd)}
prefix=${SNAPGUARD_PREFIX:-/opt/snapguard}
reports=${SNAPGUARD_REPORT_DIR:-/var/log/snapguard}
log=$(mktemp -t snapguard-provision.XXXXXX)
trap 'rm -f "$log"' EXIT

say() { printf 'provision: %s\n' "$*" >&2; }
# Run one step with its output in $log; show the output only when the step fails.
quiet() {
  local rc=0
  "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    say "failed (exit $rc): $*"
    cat "$log" >&2
    exit "$rc"
  fi
}

[ "$(id -u)" -eq 0 ] || { say "must run as root"; exit 1; }
[ -f "$src/pyproject.toml" ] || { say "no snapguard source tree at $src (set SNAPGUARD_SRC)"; exit 1; }
umask 022  # everything installed here is root's and writable by root alone, as snapguard demands

# 1. The real parts snapguard drives: runc, containerd, iptables, CRIU 4.x and its CUDA plugin.
bash "$src/packaging/install-deps.sh"

# 2. snapguard itself, in a root-owned virtual environment, its commands linked where root looks.
[ -x "$prefix/bin/python" ] || quiet python3 -m venv "$prefix"
quiet "$prefix/bin/python" -m pip install --disable-pip-version-check --no-input --upgrade pip
quiet "$prefix/bin/python" -m pip install --disable-pip-version-check --no-input "$src"
for cmd in snapguard snapguard-runc snapguard-cuda-checkpoint; do
  ln -sfn "$prefix/bin/$cmd" "/usr/local/bin/$cmd"
done
if [ ! -e /etc/snapguard/config.toml ]; then
  install -d -m 0755 /etc/snapguard
  install -m 0644 "$src/packaging/debian/config.toml" /etc/snapguard/config.toml
fi
say "snapguard $(snapguard --version | awk '{print $2}') in $prefix"

# 3. Wire snapguard into the node (containerd's runtime, state directory). `snapguard install`
# does not exist yet in every release (it is being added): call it only where this snapguard
# has it, i.e. `snapguard install --help` succeeds; without it the gate below still runs.
if snapguard install --help >/dev/null 2>&1; then
  quiet snapguard install
  say "snapguard install: done"
else
  say "snapguard install: not in this release, skipped"
fi

# 4. The gate: the image must be able to take the snapshots it is meant for.
install -d -m 0755 "$reports"
require=()
[ -z "${SNAPGUARD_IMAGE_CAPABILITIES:-}" ] || require=(--require "$SNAPGUARD_IMAGE_CAPABILITIES")
rc=0
snapguard preflight --node "${require[@]}" --junit "$reports/preflight-bake.xml" >&2 || rc=$?
snapguard preflight --node "${require[@]}" --json >"$reports/preflight-bake.json" 2>/dev/null || true
case $rc in
  0) say "gate: READY" ;;
  1) say "gate: BLOCKED, failing the bake (reports in $reports)" ;;
  *) say "gate: could not check (exit $rc), failing the bake (reports in $reports)" ;;
esac
exit "$rc"
