#!/usr/bin/env bash
#
# Tune this PC's kernel for deskchat, and undo it. The one entry point: runs
# the per-knob scripts in system/knobs/ with the wanted values from
# /etc/deskchat/tune.conf (or the tune.conf shipped next to this script).
#
#   tune.sh apply   save each old value under /run/deskchat/tune, then set
#   tune.sh revert  write the saved values back, then forget them
#   tune.sh status  one line per knob; exit 1 if an available knob differs
#   --dry-run       print what apply/revert would write; write nothing
#
# Exit codes: 0 done, 1 status differs, 2 usage or not root,
# 3 at least one write failed (the other knobs were still done).

set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly HERE
readonly KNOBS=(governor swappiness thp nr_hugepages cstate)
# shellcheck source=SCRIPTDIR/lib.sh
source "${HERE}/lib.sh"

usage() {
  echo "usage: $(basename "$0") apply|revert|status [--dry-run]"
}

# Print the knob names in the order ACTION runs them (revert: reverse).
ordered_knobs() {
  local i
  if [[ "$1" == revert ]]; then
    for (( i = ${#KNOBS[@]} - 1; i >= 0; i-- )); do echo "${KNOBS[i]}"; done
  else
    printf '%s\n' "${KNOBS[@]}"
  fi
}

main() {
  local action="" dry_run="" arg knob one rc=0
  for arg in "$@"; do
    case "${arg}" in
      apply | revert | status) action="${arg}" ;;
      --dry-run) dry_run=1 ;;
      -h | --help) usage; return 0 ;;
      *) usage >&2; return 2 ;;
    esac
  done
  if [[ -z "${action}" ]]; then
    usage >&2
    return 2
  fi
  if [[ -z "${SYSROOT}" && "${EUID}" -ne 0 && "${action}" != status && -z "${dry_run}" ]]; then
    err "tune.sh ${action} writes kernel settings under /sys and /proc: run it as root"
    return 2
  fi
  DESKCHAT_TUNE_CONF="${SYSROOT}/etc/deskchat/tune.conf"
  [[ -f "${DESKCHAT_TUNE_CONF}" ]] || DESKCHAT_TUNE_CONF="${HERE}/tune.conf"
  export DESKCHAT_TUNE_CONF DRY_RUN="${dry_run}"

  while read -r knob; do
    "${HERE}/knobs/${knob}.sh" "${action}"
    one="$?"
    (( one > rc )) && rc="${one}"
  done < <(ordered_knobs "${action}")

  if [[ "${action}" == revert && -z "${dry_run}" && -d "${SAVE_DIR}" ]]; then
    # Forget the (now empty) save tree; values that could not be restored stay.
    find "${SAVE_DIR}" -depth -type d -empty -delete
    rmdir "${SYSROOT}/run/deskchat" 2>/dev/null || true
  fi
  return "${rc}"
}

main "$@"
