#!/usr/bin/env bash
#
# Copy the API keys (/etc/deskchat/api-keys, root only) to where deskchat's
# transient user can read them: /run/deskchat-keys/api-keys, mode 0400, owned
# by the owner of /run/deskchat-keys (systemd creates that directory for the
# service's DynamicUser=, RuntimeDirectory=deskchat-keys). deskchat.service
# runs this as root ("+") before every start and on `systemctl reload`, then
# sends SIGHUP so the server reads the copy again.
# Usage: keys-sync.sh  (no options; DESKCHAT_SYSROOT=DIR works on a fake tree)
#
# Exit codes: 0 copied, 1 nothing copied (see stderr), 2 usage or not root.

set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly HERE
# shellcheck source=SCRIPTDIR/lib.sh
source "${HERE}/lib.sh"

readonly KEYS="${SYSROOT}/etc/deskchat/api-keys"
readonly RUN_DIR="${SYSROOT}/run/deskchat-keys"
# The copy in the making; removed on exit if it was not renamed in.
TMP=""

main() {
  local owner
  if (( $# )); then
    sed -n '3,11s/^# \{0,1\}//p' "$0" >&2
    exit 2
  fi
  if [[ -z "${SYSROOT}" && "${EUID}" -ne 0 ]]; then
    err "keys-sync.sh reads ${KEYS}, readable by root only: run it as root"
    exit 2
  fi
  if [[ ! -f "${KEYS}" ]]; then
    err "no ${KEYS}: run install.sh again, or create it (mode 0600; no keys = no authentication)"
    exit 1
  fi
  if [[ -n "$(find "${KEYS}" -perm /077)" ]]; then
    err "${KEYS} is readable by others than root: chmod 0600 ${KEYS}"
  fi
  if [[ ! -d "${RUN_DIR}" || -L "${RUN_DIR}" ]]; then
    err "no directory ${RUN_DIR}: deskchat.service creates it (RuntimeDirectory=)"
    exit 1
  fi
  owner="$(stat -c '%u:%g' "${RUN_DIR}")"
  # The service's user owns RUN_DIR and could swap a file there for a symlink:
  # prepare the copy in root's /run, then rename it in (rename never follows
  # a link, and a reader sees the old file or the new one, never half of it).
  trap 'rm -f "${TMP}"' EXIT
  TMP="$(mktemp "${SYSROOT}/run/.deskchat-api-keys.XXXXXX")"
  cat "${KEYS}" >"${TMP}"
  chown "${owner}" "${TMP}"
  chmod 0400 "${TMP}"
  mv -f -T "${TMP}" "${RUN_DIR}/api-keys"
  echo "copied ${KEYS} to ${RUN_DIR}/api-keys (owner ${owner}, mode 0400)"
}

main "$@"
