# Sourced at the start of every command on the lent GPU machine (no registry there): installs the
# CRIU built on the development machine (its rpath points at the libraries carried beside it), its
# CUDA plugin, the carried wheels, and snapguard's cuda-checkpoint at the pinned path where NVIDIA's
# binary would be (the GPU machine has none). Needs carry: .carry .whl snapguard/_procscan.abi3.so
set -e
REPO=$(pwd)
install -D -m 0755 .carry/criu/bin/criu /usr/local/sbin/criu
mkdir -p /opt/snapguard-criu/lib /usr/local/lib/criu
cp .carry/criu/lib/* /opt/snapguard-criu/lib/
install -m 0644 .carry/criu/plugin/cuda_plugin.so /usr/local/lib/criu/cuda_plugin.so
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$REPO:/tmp/site
PY=$(command -v python3)
cat > /usr/local/bin/cuda-checkpoint <<WRAP
#!$PY
import sys
sys.path[:0] = ["$REPO", "/tmp/site"]
from snapguard.cuda.cli import main
sys.exit(main())
WRAP
chmod 0755 /usr/local/bin/cuda-checkpoint
cat > /usr/local/bin/snapguard <<WRAP
#!$PY
import sys
sys.path[:0] = ["$REPO", "/tmp/site"]
from snapguard.cli import main
sys.exit(main())
WRAP
chmod 0755 /usr/local/bin/snapguard
export SNAPGUARD_STATE_DIR=/run/snapguard PYTHONUNBUFFERED=1
set +e
