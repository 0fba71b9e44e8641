#!/usr/bin/env bash
#
# The one loop every knob script runs: apply, revert or status over the files
# a knob owns. Sourced by system/knobs/*.sh; sources lib.sh.

# shellcheck source=SCRIPTDIR/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# Join the unique words on stdin with commas.
uniq_join() {
  sort -u | paste -sd, -
}

# run_knob NAME ACTION TARGETS_FN
# TARGETS_FN prints "FILE<TAB>WANT" for each file of the knob that exists on
# this machine. An empty WANT means the knob is opt-in and not enabled.
# Returns 0, RC_DIFFERS (status) or RC_WRITE_FAILED (apply, revert).
run_knob() {
  local name="$1" action="$2" targets_fn="$3"
  local -a files=() wants=()
  local file want rc=0 i have
  while IFS=$'\t' read -r file want; do
    files+=("${file}")
    wants+=("${want}")
  done < <("${targets_fn}")
  if (( ${#files[@]} == 0 )); then
    echo "${name}: not available"
    return 0
  fi
  case "${action}" in
    apply)
      if [[ -z "${wants[0]}" ]]; then
        echo "${name}: off in tune.conf, left alone"
        return 0
      fi
      for i in "${!files[@]}"; do
        save_set "${files[i]}" "${wants[i]}" | sed "s|^|${name}: |" || rc="${RC_WRITE_FAILED}"
      done
      ;;
    revert)
      for file in "${files[@]}"; do
        restore "${file}" | sed "s|^|${name}: |" || rc="${RC_WRITE_FAILED}"
      done
      ;;
    status)
      if [[ -z "${wants[0]}" ]]; then
        echo "${name}: off in tune.conf"
        return 0
      fi
      have="$(for i in "${!files[@]}"; do
        file="$(sys_read "${files[i]}")"
        [[ "${file}" == "${wants[i]}" ]] || echo "${file}"
      done | uniq_join)"
      if [[ -z "${have}" ]]; then
        echo "${name}: ok"
      else
        echo "${name}: differs: have ${have}, want $(printf '%s\n' "${wants[@]}" | uniq_join)"
        rc="${RC_DIFFERS}"
      fi
      ;;
    *)
      err "unknown action: ${action}"
      return 2
      ;;
  esac
  return "${rc}"
}

# Entry point of a knob script: knob_main ACTION NAME TARGETS_FN [NAME FN]...
# Runs each (NAME, TARGETS_FN) pair in order; returns the worst code.
knob_main() {
  local action="$1" rc=0 one
  shift
  while (( $# >= 2 )); do
    run_knob "$1" "${action}" "$2"
    one="$?"
    (( one > rc )) && rc="${one}"
    shift 2
  done
  return "${rc}"
}
