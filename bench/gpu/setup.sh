# Sourced at the start of every command on the lent GPU machine (no registry there): installs the
# CRIU built on the development machine (its rpath points at the libraries carried beside it), its
# CUDA plugin, the carried wheels, runc (with libseccomp beside CRIU's libraries), snapguard-runc and
# snapguard's cuda-checkpoint at the pinned path where NVIDIA's binary would be (the GPU machine has
# none), and snapguard-lab (lab/, the drills). Needs carry: .carry .whl snapguard/_procscan.abi3.so
set -e
REPO=$(pwd)
install -D -m 0755 .carry/criu/bin/criu /usr/local/sbin/criu
mkdir -p /opt/snapguard-criu/lib /usr/local/lib/criu
cp .carry/criu/lib/* /opt/snapguard-criu/lib/
install -m 0644 .carry/criu/plugin/cuda_plugin.so /usr/local/lib/criu/cuda_plugin.so
install -D -m 0755 .carry/runc/runc /usr/local/sbin/runc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$REPO:$REPO/lab:/tmp/site
PY=$(command -v python3)
# -S: no site-packages scan at start; CRIU's plugin runs this eight times inside a snapshot's stall
cat > /usr/local/bin/cuda-checkpoint <<WRAP
#!$PY -S
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
cat > /usr/local/bin/snapguard-runc <<WRAP
#!$PY
import sys
sys.path[:0] = ["$REPO", "/tmp/site"]
from snapguard.shim.entry import main
sys.exit(main())
WRAP
chmod 0755 /usr/local/bin/snapguard-runc
cat > /usr/local/bin/snapguard-lab <<WRAP
#!$PY
import sys
sys.path[:0] = ["$REPO", "$REPO/lab", "/tmp/site"]
from snapguard_lab.cli import main
sys.exit(main())
WRAP
chmod 0755 /usr/local/bin/snapguard-lab
export SNAPGUARD_STATE_DIR=/run/snapguard SNAPGUARD_RUNC=/usr/local/sbin/runc PYTHONUNBUFFERED=1
set +e
