#!/usr/bin/env bash
#
# Knob: vm.swappiness, how eagerly the kernel swaps anonymous memory (the
# model's weights) out instead of dropping page cache.
# Usage: swappiness.sh apply|revert|status

set -uo pipefail
# shellcheck source=SCRIPTDIR/../knob.sh
source "$(dirname "${BASH_SOURCE[0]}")/../knob.sh"

swappiness_targets() {
  local file="${SYSROOT}/proc/sys/vm/swappiness"
  [[ -f "${file}" ]] && printf '%s\t%s\n' "${file}" "$(conf_get swappiness)"
}

main() {
  knob_main "${1:?usage: swappiness.sh apply|revert|status}" \
    vm.swappiness swappiness_targets
}

main "$@"
