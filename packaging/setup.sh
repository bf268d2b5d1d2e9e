#!/bin/bash
# Set up snapguard on this machine as root: the real parts (install-deps.sh), then a virtual
# environment in .venv with snapguard installed editable (its C helpers are compiled by cffi
# during the install), its test dependencies and the lab (lab/: snapguard-lab). Idempotent.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bash packaging/install-deps.sh
python=${SNAPGUARD_PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
# compat mode: a plain path in a .pth file. The default editable finder imports pathlib and more
# at every interpreter start, which snapguard-runc's pass-through pays on every runc call.
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' --config-settings editable_mode=compat
# The lab (drills, test rig, example workloads as package data) is a distribution of its own,
# which the product never imports; compat mode for it too: a plain path, no finder at start.
.venv/bin/python -m pip install -q --disable-pip-version-check -e ./lab --config-settings editable_mode=compat
if [ ! -x .venv/bin/snapguard-lab ]; then
  echo "setup: .venv/bin/snapguard-lab is missing after installing ./lab" >&2
  exit 1
fi
echo "setup: snapguard $(.venv/bin/snapguard --version | awk '{print $2}') in $repo/.venv" >&2
