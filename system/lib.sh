#!/usr/bin/env bash
#
# Shared helpers for tune.sh and system/knobs/*.sh: read sysfs values, read
# tune.conf, and save-then-set / restore-what-was-saved (after tuned's
# profiles/functions). Sourced, never run. Every kernel path is prefixed with
# $DESKCHAT_SYSROOT so tests can run against a fake tree.

SYSROOT="${DESKCHAT_SYSROOT:-}"
readonly SYSROOT
readonly SAVE_DIR="${SYSROOT}/run/deskchat/tune"
# shellcheck disable=SC2034  # used by knob.sh, which sources this file
readonly RC_DIFFERS=1
readonly RC_WRITE_FAILED=3

err() {
  echo "[$(date +'%Y-%m-%dT%H:%M:%S%z')] $*" >&2
}

# Print the current value of a sysfs/procfs file. For choice files such as
# "always [madvise] never" that is the bracketed word.
sys_read() {
  local raw
  raw="$(<"$1")" || return 1
  if [[ "${raw}" =~ \[([^]]*)\] ]]; then
    raw="${BASH_REMATCH[1]}"
  fi
  printf '%s\n' "${raw}"
}

# Print KEY's value from tune.conf ($DESKCHAT_TUNE_CONF); empty when unset.
# The file is parsed, not sourced: KEY=value or KEY="value", '#' comments.
conf_get() {
  local line
  line="$(grep -E "^[[:space:]]*$1=" "${DESKCHAT_TUNE_CONF:?}" | tail -n 1)"
  line="${line#*=}"
  line="${line%%#*}"
  line="$(printf '%s' "${line}" | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//')"
  line="${line#\"}"
  printf '%s\n' "${line%\"}"
}

# Where the original value of FILE is kept: the path mirrored under SAVE_DIR.
save_path() {
  printf '%s\n' "${SAVE_DIR}/${1#"${SYSROOT}"/}"
}

# Save FILE's value (unless saved already: a second apply keeps the true
# original), then write WANT. Writes nothing if the value is already right.
save_set() {
  local file="$1" want="$2" have saved created=0
  have="$(sys_read "${file}")" || return "${RC_WRITE_FAILED}"
  [[ "${have}" == "${want}" ]] && return 0
  if [[ -n "${DRY_RUN:-}" ]]; then
    echo "would write '${want}' to ${file} (now '${have}')"
    return 0
  fi
  saved="$(save_path "${file}")"
  if [[ ! -e "${saved}" ]]; then
    mkdir -p "$(dirname "${saved}")" && printf '%s\n' "${have}" >"${saved}" \
      || return "${RC_WRITE_FAILED}"
    created=1
  fi
  if ! { printf '%s\n' "${want}" >"${file}"; } 2>/dev/null; then
    err "cannot write '${want}' to ${file}: the kernel refused it"
    (( created )) && rm -f "${saved}"
    return "${RC_WRITE_FAILED}"
  fi
  echo "set ${file} = ${want} (was ${have})"
}

# Write back the value saved for FILE, then forget it. No saved value: no-op.
restore() {
  local file="$1" saved value
  saved="$(save_path "${file}")"
  [[ -f "${saved}" ]] || return 0
  value="$(<"${saved}")"
  if [[ -n "${DRY_RUN:-}" ]]; then
    echo "would restore '${value}' to ${file}"
    return 0
  fi
  if [[ "$(sys_read "${file}" 2>/dev/null)" != "${value}" ]] \
    && ! { printf '%s\n' "${value}" >"${file}"; } 2>/dev/null; then
    err "cannot restore '${value}' to ${file}; saved value kept in ${saved}"
    return "${RC_WRITE_FAILED}"
  fi
  rm -f "${saved}"
  echo "restored ${file} = ${value}"
}
