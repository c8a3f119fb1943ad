#!/usr/bin/env bash
# Create .venv (Python 3.12) with megatron-rlhf and its test extras. Idempotent: a second run only
# reinstalls when setup.py or constraints-ci.txt changed. Used by run_default.sh and test.sh.
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

stamp=".venv/.megatron-rlhf-$(cat setup.py constraints-ci.txt | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setup_env: installing megatron-rlhf[test] (first run downloads torch, about 5 GB)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c constraints-ci.txt -e ".[test]"
  rm -f .venv/.megatron-rlhf-*
  touch "$stamp"
fi
