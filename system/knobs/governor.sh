#!/usr/bin/env bash
#
# Knob: CPU frequency scaling. The first governor from tune.conf's list that
# the kernel offers, the energy/performance preference, and intel_pstate's
# lowest allowed performance. Usage: governor.sh apply|revert|status

set -uo pipefail
# shellcheck source=SCRIPTDIR/../knob.sh
source "$(dirname "${BASH_SOURCE[0]}")/../knob.sh"

readonly CPU_DIR="${SYSROOT}/sys/devices/system/cpu"

# pick WANTED_LIST AVAILABLE_FILE: first wanted word the kernel lists (or the
# first wanted word if the kernel publishes no list).
pick() {
  local wanted="$1" avail="" word
  [[ -r "$2" ]] && avail=" $(<"$2") "
  for word in ${wanted}; do
    if [[ -z "${avail}" || "${avail}" == *" ${word} "* ]]; then
      echo "${word}"
      return 0
    fi
  done
  err "none of '${wanted}' is offered in $2:${avail}"
  return 1
}

# per_cpu FILE CONF_KEY AVAILABLE_FILE: targets for one per-CPU cpufreq file.
per_cpu() {
  local wanted dir want
  wanted="$(conf_get "$2")"
  for dir in "${CPU_DIR}"/cpu[0-9]*/cpufreq; do
    [[ -f "${dir}/$1" ]] || continue
    want=""
    if [[ -n "${wanted}" ]]; then
      want="$(pick "${wanted}" "${dir}/$3")" || continue
    fi
    printf '%s\t%s\n' "${dir}/$1" "${want}"
  done
}

governor_targets() {
  per_cpu scaling_governor governor scaling_available_governors
}

epp_targets() {
  per_cpu energy_performance_preference energy_performance_preference \
    energy_performance_available_preferences
}

min_perf_targets() {
  local file="${CPU_DIR}/intel_pstate/min_perf_pct"
  [[ -f "${file}" ]] && printf '%s\t%s\n' "${file}" "$(conf_get intel_pstate_min_perf_pct)"
}

main() {
  # The governor goes first both ways: intel_pstate refuses EPP changes while
  # the governor is "performance" (EBUSY), so EPP is restored after it.
  knob_main "${1:?usage: governor.sh apply|revert|status}" \
    governor governor_targets \
    energy_performance_preference epp_targets \
    intel_pstate_min_perf_pct min_perf_targets
}

main "$@"
