#!/usr/bin/env bash
#
# Write the nginx config for a fleet of deskchat PCs to stdout, from the
# commented template next to this script (deskchat-fleet.conf.in).
# Usage: fleet-conf.sh [options] HOST:PORT...
#   --listen [ADDR:]PORT      where tools call the fleet (default 8080)
#   --request-timeout S       the PCs' DESKCHAT_REQUEST_TIMEOUT (default 120)
#   --access-log PATH         default /var/log/nginx/deskchat-fleet.access.log
# Example: fleet-conf.sh 192.168.1.21:8080 192.168.1.22:8080 \
#            > /etc/nginx/conf.d/deskchat-fleet.conf

set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly HERE
readonly TEMPLATE="${HERE}/deskchat-fleet.conf.in"
readonly FAIL_TIMEOUT=10    # seconds a failed PC is left out
readonly CONNECT_TIMEOUT=1  # seconds to wait for a PC to accept a connection
readonly READ_MARGIN=10     # seconds nginx waits beyond the PCs' own deadline

err() {
  echo "fleet-conf.sh: $*" >&2
}

usage() {
  sed -n '3,10s/^# \{0,1\}//p' "$0"
}

main() {
  local listen=8080 request_timeout=120 access_log=/var/log/nginx/deskchat-fleet.access.log
  local pcs=() pc servers="" backups="" conf
  while (($#)); do
    case "$1" in
      --listen) listen="${2:?--listen needs a value}"; shift 2 ;;
      --request-timeout) request_timeout="${2:?--request-timeout needs a value}"; shift 2 ;;
      --access-log) access_log="${2:?--access-log needs a value}"; shift 2 ;;
      -h | --help) usage; return 0 ;;
      -*) err "unknown option $1"; usage >&2; return 2 ;;
      *) pcs+=("$1"); shift ;;
    esac
  done
  if ((${#pcs[@]} == 0)); then
    err "name at least one PC as HOST:PORT"
    usage >&2
    return 2
  fi
  if [[ ! "${listen}" =~ ^([0-9.]+:|\[[0-9a-fA-F:]+\]:)?[0-9]{1,5}$ ]]; then
    err "--listen wants [ADDR:]PORT, got '${listen}'"
    return 2
  fi
  if [[ ! "${request_timeout}" =~ ^[0-9]+$ ]]; then
    err "--request-timeout wants whole seconds, got '${request_timeout}'"
    return 2
  fi
  for pc in "${pcs[@]}"; do
    if [[ ! "${pc}" =~ ^([A-Za-z0-9.-]+|\[[0-9a-fA-F:]+\]):[0-9]{1,5}$ ]]; then
      err "'${pc}' is not HOST:PORT (an IPv6 address goes in brackets)"
      return 2
    fi
    servers+="    server ${pc} max_fails=1 fail_timeout=${FAIL_TIMEOUT}s;"$'\n'
    backups+="    server ${pc} backup max_fails=0;"$'\n'
  done

  conf="$(<"${TEMPLATE}")"
  conf="${conf//@PCS@/${pcs[*]}}"
  conf="${conf//@SERVERS@/${servers%$'\n'}}"
  conf="${conf//@BACKUPS@/${backups%$'\n'}}"
  conf="${conf//@LISTEN@/${listen}}"
  conf="${conf//@ACCESS_LOG@/${access_log}}"
  conf="${conf//@TRIES@/$((2 * ${#pcs[@]}))}"
  conf="${conf//@FAIL_TIMEOUT@/${FAIL_TIMEOUT}}"
  conf="${conf//@CONNECT_TIMEOUT@/${CONNECT_TIMEOUT}}"
  conf="${conf//@REQUEST_TIMEOUT@/${request_timeout}}"
  conf="${conf//@READ_TIMEOUT@/$((request_timeout + READ_MARGIN))}"
  printf '%s\n' "${conf}"
}

main "$@"
