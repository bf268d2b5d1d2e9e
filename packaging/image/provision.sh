#!/bin/bash
# Node-image bake: install snapguard on the image being built with the node profile
# (packaging/profiles/node.sh: snapguard's Debian package and the snapguard-criu package, nothing of
# the test rig, no compiler) and gate the bake on the capabilities the image is meant to have. Build
# the two packages once on a build host of the image's suite (packaging/build-deb.sh;
# packaging/profiles/criu.sh, which packaging/setup.sh runs), then run this as root in the image
# builder, e.g. from Packer:
#
#   provisioner "file"  { source = "./snapguard" destination = "/tmp/snapguard" }
#   provisioner "file"  { source = "./debs/" destination = "/tmp/snapguard-debs" }
#   provisioner "shell" {
#     execute_command = "sudo -E bash '{{ .Path }}'"
#     environment_vars = ["SNAPGUARD_SRC=/tmp/snapguard", "SNAPGUARD_DEB=/tmp/snapguard-debs/snapguard_0.1.0_amd64.deb",
#                         "SNAPGUARD_CRIU_DEB=/tmp/snapguard-debs/snapguard-criu_4.2.1-1_amd64.deb",
#                         "SNAPGUARD_IMAGE_CAPABILITIES=host-netns-containers,gpu"]
#     script = "./snapguard/packaging/image/provision.sh"
#   }
#
# or from cloud-init (runcmd: [[bash, /opt/snapguard-src/packaging/image/provision.sh]]).
#
# Settings (environment):
#   SNAPGUARD_SRC                 the snapguard source tree (default: the one holding this script)
#   SNAPGUARD_DEB                 snapguard's Debian package (required)
#   SNAPGUARD_CRIU_DEB            the snapguard-criu package (default: node.sh's, the newest in
#                                 /var/cache/snapguard-build/debs)
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
[ -f "$src/packaging/profiles/node.sh" ] || { say "no snapguard source tree at $src (set SNAPGUARD_SRC)"; exit 1; }
[ -n "${SNAPGUARD_DEB:-}" ] || { say "set SNAPGUARD_DEB to snapguard's Debian package (packaging/build-deb.sh)"; exit 1; }
umask 022  # everything installed here is root's and writable by root alone, as snapguard demands

# 1-2. The node profile: snapguard (its venv built for the image's python3), CRIU 4.x and its CUDA
# plugin. runc and containerd are the image's own.
quiet bash "$src/packaging/profiles/node.sh" "$SNAPGUARD_DEB" ${SNAPGUARD_CRIU_DEB:+"$SNAPGUARD_CRIU_DEB"}
say "$(snapguard --version) from $SNAPGUARD_DEB"

# 3. Wire snapguard into the node: containerd's runtime (the launcher the package carries), the
# pinned paths in /etc/snapguard/config.toml.
quiet snapguard install
say "snapguard install: done"

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
