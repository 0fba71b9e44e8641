#!/usr/bin/env bash
#
# Knob: transparent hugepages, "enabled" and "defrag". madvise lets PyTorch's
# allocator ask for huge pages for its big buffers without forcing them (and
# their compaction stalls) on every other process of the PC.
# Usage: thp.sh apply|revert|status

set -uo pipefail
# shellcheck source=SCRIPTDIR/../knob.sh
source "$(dirname "${BASH_SOURCE[0]}")/../knob.sh"

readonly THP_DIR="${SYSROOT}/sys/kernel/mm/transparent_hugepage"

enabled_targets() {
  [[ -f "${THP_DIR}/enabled" ]] \
    && printf '%s\t%s\n' "${THP_DIR}/enabled" "$(conf_get thp_enabled)"
}

defrag_targets() {
  [[ -f "${THP_DIR}/defrag" ]] \
    && printf '%s\t%s\n' "${THP_DIR}/defrag" "$(conf_get thp_defrag)"
}

main() {
  knob_main "${1:?usage: thp.sh apply|revert|status}" \
    thp_enabled enabled_targets \
    thp_defrag defrag_targets
}

main "$@"
