# Sourced by packaging/build-deb.sh and packaging/build-wheel.sh (which define log and usage):
# `parse_arch_args "$@"` reads `[--arch amd64|arm64] [OUT]` into arch (default: this machine's)
# and out_arg (empty when not given), and sets the target's names: gnu (the GNU triplet), machine
# (uname -m) and elf_machine (readelf -h's Machine).
parse_arch_args() {
  arch=$(dpkg --print-architecture)
  out_arg=""
  while [ $# -gt 0 ]; do
    case $1 in
      --arch) [ $# -ge 2 ] || { usage; exit 2; }; arch=$2; shift 2 ;;
      --arch=*) arch=${1#--arch=}; shift ;;
      -h | --help) usage; exit 0 ;;
      -*) log "unknown option $1"; usage; exit 2 ;;
      *) [ -z "$out_arg" ] || { usage; exit 2; }; out_arg=$1; shift ;;
    esac
  done
  case $arch in
    amd64) gnu=x86_64-linux-gnu machine=x86_64 elf_machine="Advanced Micro Devices X86-64" ;;
    arm64) gnu=aarch64-linux-gnu machine=aarch64 elf_machine=AArch64 ;;
    *) log "--arch $arch: amd64 or arm64"; exit 2 ;;
  esac
}
