#!/usr/bin/env bash
#
# Helpers shared by install.sh and uninstall.sh: dry-run aware actions,
# option parsing, the root check and systemd detection. Sourced, never run.

# The constants below are used by the scripts that source this file.
# shellcheck disable=SC2034

# shellcheck source=SCRIPTDIR/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

readonly UNITS=(deskchat.service deskchat-tune.service)
# The service's slice: installed beside the units, never enabled (the service
# pulls it in with Slice=).
readonly SLICE=deskchat.slice
readonly UNIT_DIR="${SYSROOT}/etc/systemd/system"
readonly CONF_DIR="${SYSROOT}/etc/deskchat"
# A priority profile is two drop-ins, system/profiles/NAME.service.conf and
# NAME.slice.conf, each installed as 10-profile.conf of its unit's .d directory:
# drop-ins apply in the order of their names, so `systemctl edit`'s
# override.conf comes after it and wins. (Installs before 2026-12-03 wrote
# profile.conf, which came after override.conf: removed on install.)
readonly PROFILE_PARTS=(service slice)
readonly OLD_PROFILE_NAME=profile.conf
readonly PROFILES=(shared-desk dedicated-pc)
# Options, set by the scripts' argument parsing.
PREFIX=/opt/deskchat
DRY_RUN=""

# The installed drop-in of a profile's part (service or slice).
profile_dropin() {
  echo "${UNIT_DIR}/deskchat.$1.d/10-profile.conf"
}

# Run a command, or only print it under --dry-run.
run() {
  if [[ -n "${DRY_RUN}" ]]; then
    echo "would run: $*"
  else
    "$@"
  fi
}

# Exit 2 unless root, or DESKCHAT_SYSROOT points at a test tree, or --dry-run.
require_root() {
  if [[ -z "${SYSROOT}" && "${EUID}" -ne 0 && -z "${DRY_RUN}" ]]; then
    err "$(basename "$0") changes /etc, /opt and systemd units: run it as root"
    exit 2
  fi
  if [[ "${PREFIX}" != /* ]]; then
    err "--prefix must be an absolute path, got '${PREFIX}'"
    exit 2
  fi
}

# True when systemd is PID 1, so systemctl can talk to it (under
# DESKCHAT_SYSROOT: when the test tree has run/systemd/system).
systemd_running() {
  [[ -d "${SYSROOT}/run/systemd/system" ]]
}

# systemctl on unit files only (enable/disable); works without systemd as
# PID 1, and inside DESKCHAT_SYSROOT.
systemctl_files() {
  run systemctl --root="${SYSROOT:-/}" "$@"
}
