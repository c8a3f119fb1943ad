#!/usr/bin/env bash
# The main job on its built-in default: sets up .venv if needed, then runs `megatron-rlhf pipeline`
# (the arithmetic task from scratch: SFT -> reward model -> GRPO and PPO -> held-out test; no
# download). With GPUs: the GPU-sized preset on every visible GPU. Without: the tiny preset on two
# CPU (gloo) processes, or one on a one-core machine. Extra arguments are config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  exec launch/torchrun.sh pipeline --config pipeline-arith-gpu "$@"
fi
cores=$(nproc 2>/dev/null || echo 1)
exec launch/torchrun.sh --nproc "$(( cores >= 2 ? 2 : 1 ))" pipeline --config pipeline-arith-tiny "$@"
