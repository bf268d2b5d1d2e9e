#!/bin/bash
# The test rig's real parts: packaging/profiles/rig.sh (this is its old name, kept for scripts that
# call it). A node image takes packaging/profiles/node.sh instead.
set -euo pipefail
exec bash "$(cd "$(dirname "$0")" && pwd)/profiles/rig.sh" "$@"
