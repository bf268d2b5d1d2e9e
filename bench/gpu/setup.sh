# Sourced from the repo root at the start of every command on the lent GPU machine (no registry
# there): `source bench/gpu/setup.sh && ...`, with carry [".carry", ".whl"], both built on the
# development machine by bench/gpu/build-carry.sh (which says what is in them and why).
#
# Installs, as root: CRIU at /usr/local/sbin/criu with its libraries in /opt/snapguard-criu/lib
# (CRIU's and runc's DT_RPATH point there, libseccomp included), its CUDA plugin in
# /usr/local/lib/criu, runc at /usr/local/sbin/runc, a huge-page tmpfs at /run/snapguard-spill for
# the take points' spills, the wheels in /tmp/site (byte-compiled, with this repo copy's modules), the C helper in this
# repo copy's snapguard/, and the wrappers cuda-checkpoint (snapguard's, at the pinned path where
# NVIDIA's binary would be: the GPU machine has none), snapguard, snapguard-runc and snapguard-lab
# (lab/, the drills) in /usr/local/bin. With a carry built by `build-carry.sh --k8s` (.carry/k8s/,
# for bench/gpu/k8s_loop.py) also containerd 2.1.9, its shim, ctr and runc 1.3.6 (its own glibc) in
# /opt/snapguard/compat, docker-registry at /usr/bin/docker-registry, busybox at /bin/busybox where
# the machine has none, and the CRI client's wheels in /tmp/site. Then exports PYTHONPATH (repo, lab, /tmp/site) and
# snapguard's settings.
#
# snapguard refuses binaries and directories that anyone but root could change (snapguard/trust/),
# and these wrappers run code from this repo copy and /tmp/site as root: so everything installed
# here is root's and writable by root alone, this repo copy is made so too, and the result is checked
# with snapguard.trust itself before anything runs.
#
# The steps run in a child `bash -eEuo pipefail` (errexit is off inside `source x && y`, and this file
# must not change the caller's shell options): on the first failure it prints one line and this file
# returns 1, so the command after && does not run.

_sg_install=$(cat <<'INSTALL'
die() { echo "bench/gpu/setup.sh: $*" >&2; exit 1; }
trap 'echo "bench/gpu/setup.sh: failed (exit $?) at: $BASH_COMMAND" >&2' ERR
REPO=$SG_REPO
cd "$REPO" || die "cannot cd to $REPO"
[ "$(id -u)" -eq 0 ] || die "must run as root"
for p in .carry/criu/bin/criu .carry/criu/plugin/cuda_plugin.so .carry/criu/lib/libseccomp.so.2 \
  .carry/runc/runc .carry/py/_procscan.abi3.so .carry/GLIBC_REQUIRED; do
  [ -f "$p" ] || die "missing $p: build it with bench/gpu/build-carry.sh and carry [\".carry\", \".whl\"]"
done
compgen -G '.whl/*.whl' >/dev/null || die "missing .whl/*.whl: build it with bench/gpu/build-carry.sh and carry [\".carry\", \".whl\"]"

# glibc is the machine's own; the carried binaries were built against Debian 12's
need=$(cat .carry/GLIBC_REQUIRED)
have=$(getconf GNU_LIBC_VERSION | awk '{print $2}')
[ "$(printf '%s\n' "$need" "$have" | sort -V | head -1)" = "$need" ] ||
  die "glibc $have here, the carried CRIU and runc need $need: rebuild them on an older distro"

# this repo copy: its snapguard/, lab/ and sitecustomize run as root through the wrappers
chown -R 0:0 "$REPO"
chmod -R go-w "$REPO"

install -d -o 0 -g 0 -m 0755 /opt/snapguard-criu /usr/local/lib/criu /usr/local/sbin /usr/local/bin
rm -rf /opt/snapguard-criu/lib.new
install -d -o 0 -g 0 -m 0755 /opt/snapguard-criu/lib.new
install -o 0 -g 0 -m 0644 .carry/criu/lib/* /opt/snapguard-criu/lib.new/
rm -rf /opt/snapguard-criu/lib
mv /opt/snapguard-criu/lib.new /opt/snapguard-criu/lib
install -o 0 -g 0 -m 0755 .carry/criu/bin/criu /usr/local/sbin/criu
install -o 0 -g 0 -m 0644 .carry/criu/plugin/cuda_plugin.so /usr/local/lib/criu/cuda_plugin.so
install -o 0 -g 0 -m 0755 .carry/runc/runc /usr/local/sbin/runc
install -o 0 -g 0 -m 0755 .carry/py/_procscan.abi3.so snapguard/_procscan.abi3.so
out=$(/usr/local/sbin/criu --version 2>&1) || die "criu does not run: $(head -1 <<<"$out")"
out=$(/usr/local/sbin/runc --version 2>&1) || die "runc does not run: $(head -1 <<<"$out")"

# --k8s: the compat stack (containerd 2.1.9, shim, ctr, runc 1.3.6), the registry, busybox
wheels=(.whl/*.whl)
if [ -d .carry/k8s ]; then
  [ -f .carry/k8s/stack.tar.xz ] && [ -f .carry/k8s/GLIBC_REQUIRED ] || die "incomplete .carry/k8s: rebuild with build-carry.sh --k8s"
  need=$(cat .carry/k8s/GLIBC_REQUIRED)
  [ "$(printf '%s\n' "$need" "$have" | sort -V | head -1)" = "$need" ] ||
    die "glibc $have here, the carried containerd and docker-registry need $need"
  kstamp=$(sha256sum <.carry/k8s/stack.tar.xz | cut -c1-16)
  if [ "$(cat /opt/snapguard/compat/.snapguard-stack 2>/dev/null)" != "$kstamp" ]; then
    kt=$(mktemp -d)
    xz -dc .carry/k8s/stack.tar.xz | tar -C "$kt" --no-same-owner -xf -
    chown -R 0:0 "$kt"
    chmod -R go-w "$kt"
    install -d -o 0 -g 0 -m 0755 /opt/snapguard
    rm -rf /opt/snapguard/compat
    mv "$kt/opt/snapguard/compat" /opt/snapguard/compat
    install -o 0 -g 0 -m 0755 "$kt/usr/bin/docker-registry" /usr/bin/docker-registry
    [ -e /bin/busybox ] || install -o 0 -g 0 -m 0755 "$kt/bin/busybox" /bin/busybox
    rm -rf "$kt"
    echo "$kstamp" >/opt/snapguard/compat/.snapguard-stack
  fi
  out=$(/opt/snapguard/compat/bin/containerd --version 2>&1) || die "containerd does not run: $(head -1 <<<"$out")"
  out=$(/opt/snapguard/compat/bin/runc --version 2>&1) || die "the compat runc does not run: $(head -1 <<<"$out")"
  out=$(/usr/bin/docker-registry --version 2>&1) || die "docker-registry does not run: $(head -1 <<<"$out")"
  wheels+=(.carry/k8s/whl/*.whl)
fi

PY=$(command -v python3) || die "no python3 on PATH"
# the wheels, once per set of wheels (a warm machine keeps /tmp/site)
stamp=$(sha256sum -- "${wheels[@]}" | sed 's#  .*/#  #' | sha256sum | cut -c1-16)
if [ "$(cat /tmp/site/.snapguard-wheels 2>/dev/null)" != "$stamp" ]; then
  rm -rf /tmp/site
  install -d -o 0 -g 0 -m 0755 /tmp/site
  out=$("$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" 2>&1) || die "pip install of the wheels failed: $(tail -1 <<<"$out")"
  echo "$stamp" >/tmp/site/.snapguard-wheels
fi
# bytecode, as an installed snapguard has it (pip compiles at install): these machines set
# PYTHONDONTWRITEBYTECODE=1, so without this every command compiled this repo copy's modules and
# /tmp/site's from source at each start (0.21 s of `snapguard notice`'s 0.41 s on the H200, and the
# cuda-checkpoint wrapper's runs inside a snapshot's stall paid it too)
out=$("$PY" -m compileall -q -j 0 snapguard lab/snapguard_lab /tmp/site 2>&1) ||
  die "compileall failed: $(tail -1 <<<"$out")"
chown -R 0:0 /tmp/site
chmod -R go-w /tmp/site

# the node's spill tmpfs (snapguard.names.SPILL_TMPFS) with huge pages, as README's "The take
# point" has a node mount it: take points spill there by default (SNAPGUARD_TAKE_SPILL_DIR=/dev/shm
# measures the 4 KiB-page tmpfs instead)
if ! grep -qs ' /run/snapguard-spill tmpfs ' /proc/mounts; then
  install -d -o 0 -g 0 -m 1777 /run/snapguard-spill
  mount -t tmpfs -o mode=1777,huge=within_size,size=50% snapguard-spill /run/snapguard-spill
fi

# NAME MODULE PATHS [INTERPRETER FLAGS]: a root-owned 0755 wrapper in /usr/local/bin
wrapper() {
  local tmp
  tmp=$(mktemp)
  cat >"$tmp" <<WRAP
#!$PY${4:+ $4}
import sys
sys.path[:0] = [$3]
from $2 import main
sys.exit(main())
WRAP
  install -o 0 -g 0 -m 0755 "$tmp" "/usr/local/bin/$1"
  rm -f "$tmp"
}
# -S: no site-packages scan at start; CRIU's plugin runs this eight times inside a snapshot's stall
wrapper cuda-checkpoint snapguard.cuda_tool "\"$REPO\", \"/tmp/site\"" -S
wrapper snapguard snapguard.cli "\"$REPO\", \"/tmp/site\""
wrapper snapguard-runc snapguard.shim.entry "\"$REPO\", \"/tmp/site\""
wrapper snapguard-lab snapguard_lab.cli "\"$REPO\", \"$REPO/lab\", \"/tmp/site\""

# snapguard's own rules, on what it runs and on where the wrappers import from
SG_PY=$PY "$PY" -S - <<'CHECK' || exit 1
import os, sys
repo = os.environ["SG_REPO"]
sys.path.insert(0, repo)
from snapguard.trust import UntrustedPathError, check_trusted_libdir, resolve_trusted
checks = [(p, "exec") for p in ("/usr/local/sbin/criu", "/usr/local/sbin/runc", "/usr/local/bin/cuda-checkpoint",
                                "/usr/local/bin/snapguard", "/usr/local/bin/snapguard-runc", "/usr/local/bin/snapguard-lab")]
if os.path.isdir(repo + "/.carry/k8s"):
    checks += [(p, "exec") for p in ("/opt/snapguard/compat/bin/containerd", "/opt/snapguard/compat/bin/ctr",
                                     "/opt/snapguard/compat/bin/containerd-shim-runc-v2",
                                     "/opt/snapguard/compat/bin/runc", "/usr/bin/docker-registry")]
checks += [(p, "dir") for p in ("/opt/snapguard-criu/lib", "/tmp/site", repo, repo + "/snapguard", repo + "/lab")]
try:
    for path, kind in checks:
        resolve_trusted(path, kind)
    check_trusted_libdir("/usr/local/lib/criu")
except UntrustedPathError as e:
    sys.exit(f"bench/gpu/setup.sh: {e}: snapguard would refuse it, or run code others control")
try:  # the interpreter is the image's, not ours to fix: say so, go on
    resolve_trusted(os.environ["SG_PY"], "exec")
except UntrustedPathError as e:
    print(f"bench/gpu/setup.sh: warning: the wrappers' interpreter {e}", file=sys.stderr)
CHECK
INSTALL
)
REPO=$(pwd)
if SG_REPO=$REPO bash -eEuo pipefail -c "$_sg_install"; then
  unset _sg_install
  export PYTHONPATH=$REPO:$REPO/lab:/tmp/site
  export SNAPGUARD_STATE_DIR=/run/snapguard SNAPGUARD_RUNC=/usr/local/sbin/runc PYTHONUNBUFFERED=1
  case ":$PATH:" in *:/usr/local/bin:*) ;; *) export PATH=/usr/local/bin:$PATH ;; esac
  case ":$PATH:" in *:/usr/local/sbin:*) ;; *) export PATH=/usr/local/sbin:$PATH ;; esac
else
  unset _sg_install
  return 1 2>/dev/null || exit 1
fi
