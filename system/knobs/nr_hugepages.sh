#!/usr/bin/env bash
#
# Knob (opt-in): vm.nr_hugepages, a pool of reserved 2 MiB pages. Off unless
# tune.conf sets nr_hugepages: PyTorch's CPU allocator uses transparent huge
# pages through madvise, not this pool, so a reservation only takes RAM away.
# Usage: nr_hugepages.sh apply|revert|status

set -uo pipefail
# shellcheck source=SCRIPTDIR/../knob.sh
source "$(dirname "${BASH_SOURCE[0]}")/../knob.sh"

nr_hugepages_targets() {
  local file="${SYSROOT}/proc/sys/vm/nr_hugepages"
  [[ -f "${file}" ]] && printf '%s\t%s\n' "${file}" "$(conf_get nr_hugepages)"
}

main() {
  knob_main "${1:?usage: nr_hugepages.sh apply|revert|status}" \
    vm.nr_hugepages nr_hugepages_targets
}

main "$@"
