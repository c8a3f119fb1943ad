#!/usr/bin/env bash
# Lint, format and type checks, as CI runs them (configured in pyproject.toml): ruff check, ruff
# format --check, mypy on megatron_rlhf/. Sets up .venv if needed. FIX=1 applies ruff's fixes and
# the formatter instead of only checking.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh lint wandb  # wandb: mypy checks the wandb sink against its own types
if [[ "${FIX:-0}" == 1 ]]; then
  .venv/bin/ruff check --fix .
  .venv/bin/ruff format .
else
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
fi
.venv/bin/mypy
