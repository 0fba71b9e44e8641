#!/usr/bin/env bash
#
# The interpreter install.sh builds the venv from. The venv links to it, so
# it must be one the sandboxed unit can run: ProtectHome=yes hides /root,
# /home and /run/user, PrivateTmp=yes replaces /tmp and /var/tmp, and the
# DynamicUser= account may not enter root's home anyway. A pyenv or conda
# Python there gives a unit that fails with status=203/EXEC. Sourced by
# install.sh, never run.

# Directories the unit's sandbox hides from the service.
readonly HIDDEN_DIRS=(/root /home /run/user /tmp /var/tmp)
readonly SYSTEM_PYTHON=/usr/bin/python3

# Exit 2 with one line that says what to do.
refuse_python() {
  err "$1; install the distribution's Python (apt-get install python3 python3-venv)" \
    "or set DESKCHAT_PYTHON to a Python 3.11+ outside ${HIDDEN_DIRS[*]}"
  exit 2
}

# Print the hidden directory PATH lies in, if any.
hidden_dir_of() {
  local dir
  for dir in "${HIDDEN_DIRS[@]}"; do
    if [[ "$1" == "${dir}" || "$1" == "${dir}"/* ]]; then
      printf '%s\n' "${dir}"
      return 0
    fi
  done
  return 1
}

# Print the interpreter to build the venv from: $DESKCHAT_PYTHON, else the
# system's /usr/bin/python3, else python3 on PATH. Exit 2 when the unit could
# not run it, it is older than 3.11, or (unless pip is skipped) it lacks venv.
choose_python() {
  local py="${DESKCHAT_PYTHON:-}" facts exe base new_enough path dir
  if [[ -z "${py}" && -x "${SYSTEM_PYTHON}" ]]; then
    py="${SYSTEM_PYTHON}"
  elif [[ -z "${py}" ]]; then
    py="$(command -v python3 || true)"
  fi
  [[ -n "${py}" && -x "${py}" ]] || refuse_python "no Python interpreter at '${py:-python3}'"
  facts="$("${py}" -c 'import os, sys
print(os.path.realpath(sys.executable))
print(os.path.realpath(sys.base_prefix))
print(int(sys.version_info >= (3, 11)))' 2>/dev/null)" \
    || refuse_python "${py} does not run"
  { read -r exe; read -r base; read -r new_enough; } <<<"${facts}"
  for path in "${exe}" "${base}"; do
    if dir="$(hidden_dir_of "${path}")"; then
      refuse_python "${py} lives in ${path}, under ${dir}, which the service's sandbox hides (its venv would fail with status=203/EXEC)"
    fi
  done
  [[ "${new_enough}" == 1 ]] || refuse_python "${py} is older than Python 3.11"
  if [[ -z "${SKIP_PIP}" ]] && ! "${py}" -c 'import ensurepip, venv' 2>/dev/null; then
    refuse_python "${py} has no venv/ensurepip module"
  fi
  printf '%s\n' "${py}"
}
