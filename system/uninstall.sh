#!/usr/bin/env bash
#
# Remove what install.sh installed: stop and disable both units (stopping
# deskchat-tune reverts the tuning), delete the unit files, the venv, the app
# and the service's state. Keeps /etc/deskchat files you edited (unedited
# defaults go) and the model cache, unless asked.
# Usage: uninstall.sh [--prefix DIR] [--purge-cache] [--purge-config] [--dry-run]

set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly HERE
# shellcheck source=SCRIPTDIR/install-lib.sh
source "${HERE}/install-lib.sh"

# Remove unedited config files; keep edited ones unless --purge-config.
remove_conf() {
  local name dest
  for name in tune.conf deskchat.env api-keys; do
    dest="${CONF_DIR}/${name}"
    run rm -f "${dest}.dist"
    [[ -e "${dest}" ]] || continue
    if [[ -n "${PURGE_CONFIG}" ]] || cmp -s "${HERE}/${name}" "${dest}"; then
      run rm -f "${dest}"
    else
      echo "kept ${dest}: it has your edits (--purge-config removes it)"
    fi
  done
  [[ -d "${CONF_DIR}" ]] && run rmdir --ignore-fail-on-non-empty "${CONF_DIR}"
  return 0
}

remove_units() {
  local unit part dropin tune_sh="${SYSROOT}${PREFIX}/app/system/tune.sh"
  # The slice too: an active slice outlives its unit file until the next boot.
  # A second uninstall (--purge-cache after a plain one) finds them gone, and
  # systemctl then fails ("not loaded"): nothing left to stop is not an error.
  if systemd_running; then
    run systemctl stop "${UNITS[@]}" "${SLICE}" || true
  fi
  # Without a running systemd nobody ran ExecStop=: revert the tuning here.
  if [[ -x "${tune_sh}" && -d "${SAVE_DIR}" ]]; then
    run "${tune_sh}" revert || err "tune.sh revert failed; see above"
  fi
  for unit in "${UNITS[@]}"; do
    [[ -e "${UNIT_DIR}/${unit}" ]] || continue
    systemctl_files disable "${unit}"
    run rm -f "${UNIT_DIR}/${unit}"
  done
  run rm -f "${UNIT_DIR}/${SLICE}"
  for part in "${PROFILE_PARTS[@]}"; do
    dropin="$(profile_dropin "${part}")"
    run rm -f "${dropin}" "$(dirname "${dropin}")/${OLD_PROFILE_NAME}"
    [[ -d "$(dirname "${dropin}")" ]] && run rmdir --ignore-fail-on-non-empty \
      "$(dirname "${dropin}")"
  done
  systemd_running && run systemctl daemon-reload
  return 0
}

main() {
  local dir
  PURGE_CACHE=""
  PURGE_CONFIG=""
  while (( $# )); do
    case "$1" in
      --prefix) PREFIX="${2:?--prefix needs a directory}"; shift ;;
      --prefix=*) PREFIX="${1#--prefix=}" ;;
      --purge-cache) PURGE_CACHE=1 ;;
      --purge-config) PURGE_CONFIG=1 ;;
      --dry-run) DRY_RUN=1 ;;
      *) sed -n '3,7s/^# \{0,1\}//p' "$0" >&2; exit 2 ;;
    esac
    shift
  done
  PREFIX="${PREFIX%/}"
  require_root
  remove_units
  remove_conf
  run rm -rf "${SYSROOT}${PREFIX}/venv" "${SYSROOT}${PREFIX}/app" \
    "${SYSROOT}/var/lib/deskchat" "${SYSROOT}/var/lib/private/deskchat"
  [[ -d "${SYSROOT}${PREFIX}" ]] && run rmdir --ignore-fail-on-non-empty "${SYSROOT}${PREFIX}"
  for dir in "${SYSROOT}/var/cache/deskchat" "${SYSROOT}/var/cache/private/deskchat"; do
    [[ -e "${dir}" || -L "${dir}" ]] || continue
    if [[ -n "${PURGE_CACHE}" ]]; then
      run rm -rf "${dir}"
    else
      echo "kept the model cache ${dir} (--purge-cache removes it)"
    fi
  done
  echo "uninstalled deskchat from ${PREFIX}"
}

main "$@"
