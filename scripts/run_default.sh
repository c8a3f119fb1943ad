#!/usr/bin/env bash
# The main job on its built-in default: sets up .venv if needed, then runs `megatron-rlhf ppo`
# on every visible GPU (or one CPU process in gloo CPU mode). Extra arguments are config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec launch/torchrun.sh ppo "$@"
