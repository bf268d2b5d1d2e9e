#!/bin/bash
# Builds, on this development machine (Debian 12, as root, from the repo root), everything that
# bench/gpu/setup.sh installs on the lent GPU machine, which reaches no registry:
#
#   .carry/criu/bin/criu             /usr/local/sbin/criu (CRIU 4.2.1 from packaging/install-deps.sh),
#                                    debug info stripped, DT_RPATH /opt/snapguard-criu/lib
#   .carry/criu/lib/                 every non-glibc library that CRIU, its CUDA plugin and runc
#                                    load (ldd's whole closure, libseccomp included), by soname;
#                                    setup.sh installs them to /opt/snapguard-criu/lib
#   .carry/criu/plugin/cuda_plugin.so  /usr/local/lib/criu/cuda_plugin.so
#   .carry/runc/runc                 Debian 12's runc 1.1.5 (/usr/sbin/runc), DT_RPATH as CRIU's
#   .carry/py/_procscan.abi3.so      the cffi C helper (snapguard/_procscan), built here for the
#                                    stable ABI, so Python 3.12 there loads it; setup.sh puts it in
#                                    the repo copy's snapguard/
#   .carry/GLIBC_REQUIRED            the newest GLIBC_x.y symbol version those ELF files need;
#                                    setup.sh refuses an older glibc there in one line
#   .carry/BUILD-INFO                what was built from what
#   .carry/k8s/                      only with --k8s (bench/gpu/k8s_loop.py: the Kubernetes loop):
#     stack.tar.xz                   containerd 2.1.9, its runc v2 shim, ctr and runc 1.3.6 with its own
#                                    glibc (/opt/snapguard/compat, packaging/install-deps.sh), Debian's
#                                    docker-registry (/usr/bin/docker-registry) and the static busybox
#                                    the lab's images are built from (/bin/busybox), at those paths; one
#                                    solid xz stream, since the Go binaries share most of their bytes
#     GLIBC_REQUIRED                 the newest GLIBC_x.y those of them on the machine's glibc need
#     whl/                           cp312 wheels of the lab's CRI client: grpcio, grpcio-tools,
#                                    protobuf (the versions of this repo's venv: the stubs are compiled
#                                    at run time and must match the runtime) and pyroute2 (netns)
#   .whl/                            cp312 manylinux / pure-Python wheels of snapguard's runtime
#                                    dependencies that the GPU machine's image lacks
#
# Carry both with the run tool: carry [".carry", ".whl"], command `source bench/gpu/setup.sh && ...`.
#
# Why DT_RPATH (patchelf --force-rpath) and not DT_RUNPATH: the loader reads an executable's
# DT_RUNPATH for its direct dependencies only, so libbsd would find libmd, and libgnutls its
# nettle/gmp/idn2/..., only in the GPU machine's own /lib, where they are missing or of other
# versions. DT_RPATH serves the whole tree of a binary whose libraries have no DT_RUNPATH of their
# own (checked below), and comes before LD_LIBRARY_PATH, so the GPU machine's CUDA paths cannot
# shadow a carried library. glibc itself (libc, libm, libpthread, libdl, librt, libresolv, the
# loader) is not carried: the binaries need glibc >= .carry/GLIBC_REQUIRED there (2.35 for this
# build; Debian 12 has 2.36). KINDS.md names no distro or glibc for the GPU machine's image; its
# python3 is 3.12.3, Ubuntu 24.04's (glibc 2.39), which is a lead, not a reading: setup.sh checks.
#
# The build verifies itself: each binary and the plugin resolve and run (criu --version, runc
# --version) inside a chroot that holds only this machine's glibc and the carried files, so a
# library left out fails here, not on the GPU machine; and, where a Python 3.12 exists here, the
# wheels install and import and the C helper loads and agrees with the pure-Python scanner under it.
#
# Idempotent: it builds in a scratch directory and replaces .carry and .whl only when all is well.
# Inputs (override by environment): SNAPGUARD_CRIU_SRC, SNAPGUARD_CRIU_PLUGIN_SRC, SNAPGUARD_RUNC_SRC,
# SNAPGUARD_BUILD_PY (python with cffi and setuptools, default .venv/bin/python, else python3),
# SNAPGUARD_PY312 (a Python 3.12 for the import test; found under pyenv when unset).
set -euo pipefail

K8S=0
for arg; do
  case $arg in
    --k8s) K8S=1 ;;
    *) printf 'build-carry: unknown argument %s (--k8s is the one there is)\n' "$arg" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$(readlink -f "$0")")/../.."
REPO=$(pwd)

CRIU_SRC=${SNAPGUARD_CRIU_SRC:-/usr/local/sbin/criu}
PLUGIN_SRC=${SNAPGUARD_CRIU_PLUGIN_SRC:-/usr/local/lib/criu/cuda_plugin.so}
RUNC_SRC=${SNAPGUARD_RUNC_SRC:-/usr/sbin/runc}
CRIU_VERSION=4.2.1
RUNC_VERSION=1.1.5
LIBDIR_THERE=/opt/snapguard-criu/lib # setup.sh installs .carry/criu/lib here
TREE_LIMIT=$((64 << 20))              # the run tool's limit on what travels
TREE_WARN=$((48 << 20))

# snapguard's runtime dependencies (pyproject.toml) and theirs, pinned to the versions of this
# repo's development venv. Not carried, since the GPU image has them (KINDS.md's package list,
# 2026-11-17): nvidia-ml-py (>=12.535 wanted), attrs (>=22.2.0, for jsonschema and referencing),
# typing-extensions (>=4.4.0, for referencing), and torch, which must never be carried.
WHEELS=(
  cffi==2.1.1                       # C helper's backend; snapguard.cuda._driver (ABI mode)
  pycparser==3.12                   # cffi's cdef parser, used at run time by _driver
  pyelftools==0.33
  jsonschema==4.26.0
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  rpds-py==2026.9.1
)
# --k8s: the lab's CRI client and network namespaces, pinned to this repo's venv
K8S_WHEELS=(grpcio==1.85.3 grpcio-tools==1.85.1 protobuf==7.36.2 pyroute2==0.9.7)
K8S_FILES=(/opt/snapguard/compat /usr/bin/docker-registry /bin/busybox)
# only what pip matches exactly; manylinux_2_17 (manylinux2014) is what cffi and rpds-py ship
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
  manylinux1_x86_64)

# glibc's own libraries: the GPU machine has its own, and they must match its loader
GLIBC_SONAMES='^(linux-vdso\.so\.1|ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|libresolv\.so\.2|libutil\.so\.1|libanl\.so\.1)$'

log() { printf 'build-carry: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (the chroot check; the carried files must be root's)"
for f in pyproject.toml bench/gpu/setup.sh c_helpers/build_procscan.py; do
  [ -f "$f" ] || die "not snapguard's repo: $REPO"
done
[ -x "$CRIU_SRC" ] || die "no CRIU at $CRIU_SRC: run packaging/install-deps.sh first"
[ -f "$PLUGIN_SRC" ] || die "no CUDA plugin at $PLUGIN_SRC: run packaging/install-deps.sh first"
[ -x "$RUNC_SRC" ] || die "no runc at $RUNC_SRC: run packaging/install-deps.sh first (Debian's runc)"
grep -q "Version: $CRIU_VERSION\$" <<<"$("$CRIU_SRC" --version)" || die "$CRIU_SRC is not CRIU $CRIU_VERSION"
grep -q "^runc version $RUNC_VERSION" <<<"$("$RUNC_SRC" --version)" || die "$RUNC_SRC is not runc $RUNC_VERSION"

if ! command -v patchelf >/dev/null; then
  log "installing patchelf (Debian package)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends patchelf >/dev/null
fi
for tool in patchelf ldd readelf objdump nm strip chroot; do
  command -v "$tool" >/dev/null || die "$tool is missing (Debian: binutils, coreutils, libc-bin, patchelf)"
done

BUILD_PY=${SNAPGUARD_BUILD_PY:-}
if [ -z "$BUILD_PY" ]; then
  if [ -x .venv/bin/python ]; then BUILD_PY=.venv/bin/python; else BUILD_PY=python3; fi
fi
"$BUILD_PY" -c 'import cffi, setuptools' 2>/dev/null ||
  die "$BUILD_PY lacks cffi or setuptools (pip install -e . in .venv, or set SNAPGUARD_BUILD_PY)"

PY312=${SNAPGUARD_PY312:-}
if [ -z "$PY312" ]; then
  for p in /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if [ -x "$p" ]; then PY312=$p; break; fi
  done
fi

STAGE=$(mktemp -d /tmp/snapguard-carry.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT
C=$STAGE/carry
mkdir -p "$C/criu/bin" "$C/criu/lib" "$C/criu/plugin" "$C/runc" "$C/py" "$STAGE/whl"

# carry_deps ELF...: copy every non-glibc library ldd lists (the whole closure) into criu/lib
carry_deps() {
  local f name arrow path rest
  for f; do
    while read -r name arrow path rest; do
      [ "$arrow" = "=>" ] || continue # the vdso, the loader
      [ "$path" != not ] || die "$f: $name not found by ldd here"
      [[ $name =~ $GLIBC_SONAMES ]] && continue
      if [ ! -e "$C/criu/lib/$name" ]; then
        install -m 0644 "$path" "$C/criu/lib/$name" # follows the soname link to the real file
      fi
    done < <(ldd "$f")
  done
}

# CRIU: debug info stripped (6 MB -> 2 MB; symbols kept for backtraces), rpath set
install -m 0755 "$CRIU_SRC" "$C/criu/bin/criu"
strip --strip-debug "$C/criu/bin/criu"
patchelf --force-rpath --set-rpath "$LIBDIR_THERE" "$C/criu/bin/criu"
install -m 0644 "$PLUGIN_SRC" "$C/criu/plugin/cuda_plugin.so"
install -m 0755 "$RUNC_SRC" "$C/runc/runc"
patchelf --force-rpath --set-rpath "$LIBDIR_THERE" "$C/runc/runc"
carry_deps "$CRIU_SRC" "$PLUGIN_SRC" "$RUNC_SRC"
[ -e "$C/criu/lib/libseccomp.so.2" ] || die "runc's libseccomp.so.2 was not collected"
for lib in "$C"/criu/lib/*; do
  # a library's own DT_RUNPATH would switch the binary's DT_RPATH off for that library's needs
  if readelf -d "$lib" | grep -q '(RUNPATH)'; then die "$(basename "$lib") has a DT_RUNPATH of its own"; fi
done

# The C helper, built for the stable ABI: cffi's generated C defines Py_LIMITED_API and setuptools
# names it .abi3.so (py_limited_api), so CPython 3.12 there loads what 3.11 builds here.
log "building the C helper with $BUILD_PY"
# a fixed build dir (ignored by git), so that a rebuild gives the same bytes
PYB=c_helpers/_build/carry
rm -rf "$PYB"
if ! "$BUILD_PY" setup.py -q build_ext --build-lib "$PYB/lib" --build-temp "$PYB/tmp" \
  >"$STAGE/procscan.log" 2>&1; then
  tail -20 "$STAGE/procscan.log" >&2
  die "the C helper did not build"
fi
SO=$PYB/lib/snapguard/_procscan.abi3.so
[ -f "$SO" ] || { tail -20 "$STAGE/procscan.log" >&2; die "no _procscan.abi3.so (no compiler or headers?)"; }
grep -q 'define Py_LIMITED_API' "$PYB/tmp/snapguard._procscan.c" ||
  die "cffi's generated C does not define Py_LIMITED_API"
# only the stable ABI: _Py_Dealloc is the one underscored name in it (Py_DECREF's, abi_only)
bad=$(nm -D --undefined-only "$SO" | awk '{print $NF}' | grep -E '^_Py' | grep -v '^_Py_Dealloc$' || true)
[ -z "$bad" ] || die "_procscan uses symbols outside the stable ABI: $bad"
patchelf --remove-rpath "$SO" # the build interpreter's lib dir means nothing there
install -m 0755 "$SO" "$C/py/_procscan.abi3.so"

# Wheels: cp312 builds for x86-64 manylinux, or pure Python; one version of each
log "downloading wheels: ${WHEELS[*]%%==*}"
plat_args=()
for p in "${PLATFORMS[@]}"; do plat_args+=(--platform "$p"); done
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${plat_args[@]}" -d "$STAGE/whl" "${WHEELS[@]}" \
  >"$STAGE/pip.log" 2>&1 || { tail -20 "$STAGE/pip.log" >&2; die "pip download failed"; }
n=0
declare -A seen=()
for w in "$STAGE"/whl/*.whl; do
  base=$(basename "$w")
  [[ $base =~ -(cp312-cp312|cp3[0-9]*-abi3|py3-none|py2\.py3-none)-(any|manylinux[^-]*x86_64[^-]*)\.whl$ ]] ||
    die "$base is not a cp312/abi3/py3 x86-64 manylinux wheel"
  proj=${base%%-*}
  proj=${proj,,}
  [ -z "${seen[$proj]:-}" ] || die "two wheels of $proj"
  seen[$proj]=1
  n=$((n + 1))
done
[ "$n" -eq "${#WHEELS[@]}" ] || die "expected ${#WHEELS[@]} wheels, got $n"

# --k8s: the compat stack, the registry and busybox in one xz stream; the CRI client's wheels
if [ "$K8S" = 1 ]; then
  for f in "${K8S_FILES[@]}"; do [ -e "$f" ] || die "no $f: run packaging/install-deps.sh first"; done
  for f in /opt/snapguard/compat/bin/{containerd,containerd-shim-runc-v2,ctr,runc}; do
    [ -x "$f" ] || die "no $f: run packaging/install-deps.sh first"
  done
  mkdir -p "$C/k8s/whl"
  log "packing the k8s stack (xz -9e, a minute or two)"
  tar -C / --owner=0 --group=0 -cf - "${K8S_FILES[@]#/}" | xz -T2 -9e --lzma2=dict=192MiB >"$C/k8s/stack.tar.xz"
  k8s_req=$(for f in /opt/snapguard/compat/bin/{containerd,containerd-shim-runc-v2,ctr} /usr/bin/docker-registry; do
    objdump -T "$f" | grep -o 'GLIBC_[0-9][0-9.]*' || true
  done | sed 's/GLIBC_//' | sort -uV | tail -1)
  echo "${k8s_req:-2.2.5}" >"$C/k8s/GLIBC_REQUIRED"
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${plat_args[@]}" -d "$C/k8s/whl" "${K8S_WHEELS[@]}" \
    >"$STAGE/pip-k8s.log" 2>&1 || { tail -20 "$STAGE/pip-k8s.log" >&2; die "pip download of the k8s wheels failed"; }
  [ "$(ls "$C"/k8s/whl/*.whl | wc -l)" -eq "${#K8S_WHEELS[@]}" ] || die "expected ${#K8S_WHEELS[@]} k8s wheels"
fi

# glibc: the newest symbol version any carried ELF file needs (not the wheels': manylinux says)
glibc_req=$(for f in "$C"/criu/bin/criu "$C"/criu/lib/* "$C"/criu/plugin/*.so "$C"/runc/runc "$C"/py/*.so; do
  objdump -T "$f" | grep -o 'GLIBC_[0-9][0-9.]*' || true
done | sed 's/GLIBC_//' | sort -uV | tail -1)
[ -n "$glibc_req" ] || die "could not read the glibc symbol versions"
echo "$glibc_req" >"$C/GLIBC_REQUIRED"

# Check 1: in a chroot holding only this machine's glibc and the carried files at the paths
# setup.sh installs them to, everything resolves inside the carry and the binaries run.
R=$STAGE/root
mkdir -p "$R/lib64" "$R/lib/x86_64-linux-gnu" "$R$LIBDIR_THERE" "$R/usr/local/sbin" "$R/usr/local/lib/criu" "$R/tmp"
cp -L /lib64/ld-linux-x86-64.so.2 "$R/lib64/"
for l in libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1 libresolv.so.2; do
  cp -L "/lib/x86_64-linux-gnu/$l" "$R/lib/x86_64-linux-gnu/"
done
cp "$C"/criu/lib/* "$R$LIBDIR_THERE/"
cp "$C/criu/bin/criu" "$C/runc/runc" "$R/usr/local/sbin/"
cp "$C/criu/plugin/cuda_plugin.so" "$R/usr/local/lib/criu/"
for f in /usr/local/sbin/criu /usr/local/sbin/runc /usr/local/lib/criu/cuda_plugin.so; do
  out=$(chroot "$R" /lib64/ld-linux-x86-64.so.2 --list "$f" 2>&1) || die "$f does not resolve: $out"
  while read -r name arrow path rest; do
    [ "$arrow" = "=>" ] || continue
    [[ $name =~ $GLIBC_SONAMES ]] && continue
    [[ $path == "$LIBDIR_THERE/"* ]] || die "$f: $name resolves to $path, not to the carried $LIBDIR_THERE"
  done <<<"$out"
done
criu_v=$(chroot "$R" /usr/local/sbin/criu --version 2>&1) || die "criu does not run in the chroot: $criu_v"
grep -q "Version: $CRIU_VERSION\$" <<<"$criu_v" || die "criu in the chroot says: $criu_v"
runc_v=$(chroot "$R" /usr/local/sbin/runc --version 2>&1) || die "runc does not run in the chroot: $runc_v"
grep -q "libseccomp: " <<<"$runc_v" || die "runc in the chroot says: $runc_v"
log "chroot check: criu $CRIU_VERSION and runc $RUNC_VERSION run on glibc alone plus the carry"
if [ "$K8S" = 1 ]; then
  xz -dc "$C/k8s/stack.tar.xz" | tar -C "$R" -xf -
  for cmd in "/opt/snapguard/compat/bin/containerd --version" "/opt/snapguard/compat/bin/ctr --version" \
    "/opt/snapguard/compat/bin/containerd-shim-runc-v2 -v" "/opt/snapguard/compat/bin/runc --version" \
    "/usr/bin/docker-registry --version" "/bin/busybox true"; do
    # shellcheck disable=SC2086 # a fixed command line of this file
    out=$(chroot "$R" $cmd 2>&1) || die "$cmd does not run in the chroot: $out"
  done
  grep -q '2\.1\.9' <<<"$(chroot "$R" /opt/snapguard/compat/bin/containerd --version)" || die "the carried containerd is not 2.1.9"
  grep -q '^runc version 1\.3\.6' <<<"$(chroot "$R" /opt/snapguard/compat/bin/runc --version)" || die "the carried compat runc is not 1.3.6"
  log "chroot check: containerd 2.1.9, its shim, ctr, runc 1.3.6, docker-registry and busybox run"
fi

# Check 2: under Python 3.12, the wheels install and import, and the C helper loads and agrees
# with the pure-Python scanner. attrs and typing-extensions stand in for the GPU image's own.
# -P: the tree under test, not the one the build runs in (the current directory), is imported.
if [ -n "$PY312" ]; then
  { "$PY312" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      -d "$STAGE/image-whl" 'attrs>=22.2.0' 'typing-extensions>=4.4.0' &&
    "$PY312" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
      --no-cache-dir --target "$STAGE/site" "$STAGE"/whl/*.whl "$STAGE"/image-whl/*.whl &&
    if [ "$K8S" = 1 ]; then
      "$PY312" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
        --no-cache-dir --target "$STAGE/site" "$C"/k8s/whl/*.whl
    fi
  } >"$STAGE/pip312.log" 2>&1 || { tail -20 "$STAGE/pip312.log" >&2; die "pip under $PY312 failed"; }
  mkdir -p "$STAGE/tree"
  cp -r snapguard "$STAGE/tree/"
  find "$STAGE/tree" -name '__pycache__' -prune -exec rm -rf {} + -o -name '*.so' -exec rm -f {} +
  cp "$C/py/_procscan.abi3.so" "$STAGE/tree/snapguard/"
  PYTHONPATH="$STAGE/tree:$STAGE/site" PYTHONDONTWRITEBYTECODE=1 "$PY312" -S -P -c '
import os, sys
assert sys.version_info[:2] == (3, 12), sys.version
import cffi, _cffi_backend, pycparser, elftools.elf.elffile, jsonschema, referencing, rpds
from snapguard.preflight import scan
assert scan.have_c_helper(), "the C helper did not load"
pids = [os.getpid(), os.getppid()]
# each scanner sees its own open /proc/PID/fd while it reads; everything else must agree
c, p = ([m for m in sorted(f(pids, ("/",))) if not m.path.startswith("/proc/")]
        for f in (scan.scan_c, scan.scan_python))
assert c and c == p, "the C helper and the Python scanner disagree"
from snapguard.image import manifest
manifest._validator()
from snapguard.cuda import _driver
cffi.FFI().cdef(_driver._CDEF)
print("python %s: wheels import, _procscan loads, %d matches agree" % (sys.version.split()[0], len(c)))
' >&2 || die "the Python 3.12 check failed"
  if [ "$K8S" = 1 ]; then
    cp -r lab "$STAGE/tree/"
    find "$STAGE/tree/lab" -name '__pycache__' -prune -exec rm -rf {} +
    PYTHONPATH="$STAGE/tree:$STAGE/tree/lab:$STAGE/site" PYTHONDONTWRITEBYTECODE=1 "$PY312" -S -P -c '
import sys
import grpc, pyroute2
from snapguard_lab.cri import api
pb, services = api()
assert pb.CheckpointContainerRequest(container_id="x").SerializeToString() and services.RuntimeServiceStub
print("python %s: grpcio %s compiles and loads the CRI stubs; pyroute2 imports" % (sys.version.split()[0], grpc.__version__))
' >&2 || die "the Python 3.12 check of the k8s wheels failed"
  fi
else
  log "no Python 3.12 here: skipped the import check (set SNAPGUARD_PY312)"
fi

# Record and replace
{
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME"), glibc $(getconf GNU_LIBC_VERSION | awk '{print $2}')"
  echo "needs glibc >= $glibc_req on the GPU machine"
  echo "criu $CRIU_VERSION from $CRIU_SRC sha256 $(sha256sum <"$CRIU_SRC" | cut -c1-64)"
  echo "cuda_plugin.so from $PLUGIN_SRC sha256 $(sha256sum <"$PLUGIN_SRC" | cut -c1-64)"
  echo "runc $RUNC_VERSION from $RUNC_SRC sha256 $(sha256sum <"$RUNC_SRC" | cut -c1-64) ($(dpkg-query -W -f='${Package} ${Version}' runc 2>/dev/null || echo 'not from dpkg'))"
  echo "rpath of criu and runc: $LIBDIR_THERE"
  echo "libraries: $(cd "$C/criu/lib" && echo *)"
  echo "_procscan.abi3.so built by $("$BUILD_PY" -c 'import sys, cffi; print("Python", sys.version.split()[0], "cffi", cffi.__version__)')"
  echo "wheels: $(cd "$STAGE/whl" && echo *.whl)"
  if [ "$K8S" = 1 ]; then
    echo "k8s: stack.tar.xz of ${K8S_FILES[*]} (compat: $(tr '\n' ' ' </opt/snapguard/compat/PACKAGES | cut -c1-300)), needs glibc >= $(cat "$C/k8s/GLIBC_REQUIRED")"
    echo "k8s wheels: $(cd "$C/k8s/whl" && echo *.whl)"
  fi
} >"$C/BUILD-INFO"
chmod -R go-w "$C" "$STAGE/whl"
chmod 0644 "$STAGE"/whl/*.whl
rm -rf .carry .whl
mv "$C" .carry
mv "$STAGE/whl" .whl

# Report: what was built, and what the run tool would send (tracked and untracked-not-ignored
# files, plus the carried .carry and .whl)
log "built:"
(cd .carry && find . -type f -printf '%10s  .carry/%P\n' | sort -k2) >&2
(cd .whl && find . -type f -printf '%10s  .whl/%P\n' | sort -k2) >&2
carry_bytes=$(du -sb .carry .whl | awk '{s += $1} END {print s}')
tree_bytes=$({ git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null || true; } |
  awk '{s += $1} END {print s + 0}')
total=$((carry_bytes + tree_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
log "carry: .carry + .whl = $(mib "$carry_bytes"); the tree (tracked + untracked-not-ignored) = $(mib "$tree_bytes"); total $(mib "$total") of the 64 MiB the run tool takes"
log "needs glibc >= $glibc_req on the GPU machine (setup.sh checks)"
[ "$total" -le "$TREE_LIMIT" ] || die "over the run tool's 64 MiB"
[ "$total" -le "$TREE_WARN" ] || log "warning: over 48 MiB; little room left for other carried paths"
log "run tool: carry [\".carry\", \".whl\"], command: source bench/gpu/setup.sh && ..."
