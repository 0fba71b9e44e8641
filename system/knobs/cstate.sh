#!/usr/bin/env bash
#
# Knob (opt-in): a per-CPU limit on idle-state exit latency, through the PM QoS
# file power/pm_qos_resume_latency_us. Off unless tune.conf sets
# cstate_latency_us ("n/a" forbids all idle states; "0" means no limit).
# Usage: cstate.sh apply|revert|status

set -uo pipefail
# shellcheck source=SCRIPTDIR/../knob.sh
source "$(dirname "${BASH_SOURCE[0]}")/../knob.sh"

cstate_targets() {
  local want file
  want="$(conf_get cstate_latency_us)"
  for file in "${SYSROOT}"/sys/devices/system/cpu/cpu[0-9]*/power/pm_qos_resume_latency_us; do
    [[ -f "${file}" ]] && printf '%s\t%s\n' "${file}" "${want}"
  done
}

main() {
  knob_main "${1:?usage: cstate.sh apply|revert|status}" \
    cpu_resume_latency cstate_targets
}

main "$@"
