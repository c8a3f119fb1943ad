#!/usr/bin/env bash
# Create .venv (Python 3.12) with megatron-rlhf and the extras named as arguments:
#   scripts/setup_env.sh            runtime dependencies only (the main job: run_default.sh)
#   scripts/setup_env.sh test       + the test suite's (test.sh)
#   scripts/setup_env.sh lint       + ruff, mypy and stubs (lint.sh)
# Idempotent: it installs again only when setup.py or constraints-ci.txt changed, or when an extra is
# asked for that .venv does not have yet (extras accumulate: a later runtime-only call keeps them).
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if command -v pyenv >/dev/null 2>&1 && PYENV_VERSION=3.12 pyenv which python3.12 >/dev/null 2>&1; then
    PYENV_VERSION=3.12 pyenv which python3.12; return
  fi
  command -v python3.12 || true
}

if [ ! -x .venv/bin/python ]; then
  py=$(find_python)
  if [ -z "$py" ]; then
    echo "setup_env: Python 3.12 not found (megatron-core needs >= 3.12); set PYTHON=/path/to/python3.12" >&2
    exit 1
  fi
  echo "setup_env: creating .venv with $py"
  "$py" -m venv .venv
fi
if ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  echo "setup_env: .venv has Python $(.venv/bin/python -V 2>&1 | cut -d' ' -f2); megatron-core needs >= 3.12:" \
       "delete .venv and run this again with Python 3.12 (PYTHON=/path/to/python3.12)" >&2
  exit 1
fi

# The stamp's name says which setup.py and constraints it installed; its lines, which extras.
stamp=".venv/.megatron-rlhf-$(cat setup.py constraints-ci.txt | sha256sum | cut -c1-16)"
installed=()
[ -f "$stamp" ] && mapfile -t installed <"$stamp"
missing=0
for extra in "$@"; do
  [[ " ${installed[*]} " == *" $extra "* ]] || missing=1
done
if [ ! -f "$stamp" ] || [ "$missing" -eq 1 ]; then
  mapfile -t wanted < <(printf '%s\n' "${installed[@]}" "$@" | sed '/^$/d' | sort -u)
  spec="."
  [ "${#wanted[@]}" -gt 0 ] && spec=".[$(IFS=,; echo "${wanted[*]}")]"
  echo "setup_env: installing megatron-rlhf$([ "$spec" = . ] || echo "${spec#.}") (first run downloads torch, about 5 GB)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c constraints-ci.txt -e "$spec"
  rm -f .venv/.megatron-rlhf-*
  printf '%s\n' "${wanted[@]}" >"$stamp"
fi
