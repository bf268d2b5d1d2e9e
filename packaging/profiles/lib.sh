# Shared by the install profiles (sourced, not run): logging and apt installs of Debian packages.
# Each profile sets PROFILE (its name in log lines) before sourcing this file.

log() { printf '%s: %s\n' "${PROFILE:-profile}" "$*" >&2; }

require_root() { [ "$(id -u)" -eq 0 ] || { log "must run as root"; exit 1; }; }

# the packages of "$@" that are not installed
missing_pkgs() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' || echo "$p"
  done
}

apt_updated=0
apt_update_once() {
  if [ $apt_updated -eq 0 ]; then apt-get update -qq; apt_updated=1; fi
}

# apt-get install of the packages of "$@" that are missing, without recommends
apt_install() {
  local want
  want=$(missing_pkgs "$@")
  [ -n "$want" ] || return 0
  apt_update_once
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $want >/dev/null
}
