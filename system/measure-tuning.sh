#!/usr/bin/env bash
#
# What system/tune.sh buys on this PC: the latency benchmark (python -m bench
# --latency) with the kernel tuning applied, then reverted, printed as one
# table. The tuning is left as it was found (applied again if it was).
# Run from a deskchat checkout, as root, with the deskchat service stopped
# (it would compete for the CPU):
#
#   sudo system/measure-tuning.sh [bench options]
#   e.g. sudo system/measure-tuning.sh --settings default,dedicated --seconds 60
#
# DESKCHAT_BENCH_PYTHON: the Python with deskchat's packages (default: the
# checkout's .venv, else /opt/deskchat/venv/bin/python). Exit codes: 0 done,
# 2 usage or not root, else the failing step's code.

set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly HERE
readonly REPO="${HERE}/.."
# shellcheck source=SCRIPTDIR/lib.sh
source "${HERE}/lib.sh"

bench_python() {
  local candidate
  for candidate in "${DESKCHAT_BENCH_PYTHON:-}" "${REPO}/.venv/bin/python" \
    /opt/deskchat/venv/bin/python; do
    if [[ -n "${candidate}" && -x "${candidate}" ]]; then
      printf '%s\n' "${candidate}"
      return 0
    fi
  done
  err "no Python with deskchat's packages: make install, or set DESKCHAT_BENCH_PYTHON"
  return 2
}

# Run the benchmark once: LABEL, JSON file, then the operator's options.
bench() {
  local label="$1" json="$2"
  shift 2
  echo "== ${label}: $("${HERE}/tune.sh" status | tr '\n' ';')"
  (cd "${REPO}" && "${PYTHON}" -m bench --latency --label "${label}" --json "${json}" "$@")
}

main() {
  local out was_tuned=0 rc
  if [[ " $* " == *" -h "* || " $* " == *" --help "* ]]; then
    sed -n '3,14s/^# \{0,1\}//p' "$0"
    return 0
  fi
  if [[ -z "${SYSROOT}" && "${EUID}" -ne 0 ]]; then
    err "measure-tuning.sh applies and reverts kernel settings: run it as root"
    return 2
  fi
  PYTHON="$(bench_python)" || return 2
  [[ -d "${SAVE_DIR}" ]] && was_tuned=1  # deskchat-tune (or tune.sh apply) ran
  out="$(mktemp -d)"
  # Whatever happens below: the machine's tuning as it was found.
  # shellcheck disable=SC2064  # expand now: these values are fixed
  trap "leave_as_found ${was_tuned}; rm -rf '${out}'" EXIT

  "${HERE}/tune.sh" apply >/dev/null
  rc="$?"
  (( rc == 0 || rc == RC_WRITE_FAILED )) || return "${rc}"
  bench tuned "${out}/tuned.json" "$@" || return "$?"
  "${HERE}/tune.sh" revert >/dev/null || return "$?"
  bench untuned "${out}/untuned.json" "$@" || return "$?"
  (cd "${REPO}" && "${PYTHON}" -m bench --latency --merge "${out}/tuned.json" \
    "${out}/untuned.json")
}

# Re-apply the tuning if it was applied when we started, else make sure it is
# reverted.
leave_as_found() {
  if (( $1 )); then
    "${HERE}/tune.sh" apply >/dev/null
  else
    "${HERE}/tune.sh" revert >/dev/null
  fi
}

main "$@"
