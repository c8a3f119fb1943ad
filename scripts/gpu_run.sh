#!/usr/bin/env bash
# Run the GPU test tier and the benchmarks on any CUDA machine; logs and JSON results go to one folder.
#
#   scripts/gpu_run.sh [-o OUT_DIR] [STAGE ...] [-- E2E_ARGS ...]
#
# Stages (default: all):
#   tests     the GPU test tier: the tests marked gpu (pytest -m gpu; TESTS, default "tests", picks files to
#             split the tier over calls)
#   bench     scripts/bench/: model import (TP1, and TP2 with 2+ GPUs), the actor update (profiled), generation
#             vs HF generate (profiled; with 2+ GPUs the TP2 -> TP1 x DP2 weight copy), checkpoint save/load and
#             its copy to remote storage,
#             the host work of a step, a LoRA actor's merge for generation (in place vs into a copy), a multi-turn
#             rollout vs single-turn generation of as many tokens
#   kernels   scripts/bench/: the decode step's kernels, the SwiGLU kernel, the training step's log-prob kernels and
#             attention against Liger-Kernel (where installed), SDPA's backends, varlen and FlexAttention, attention's
#             first call on shapes not seen before, and a Triton GEMM with SwiGLU in its epilogue against cuBLAS
#   pipeline  the GPU preset of `megatron-rlhf pipeline` (SFT -> RM -> GRPO and PPO), seed 1
#   seeds     its RL stages again with seeds 2 and 3, from seed 1's SFT and reward model (after pipeline)
#   tool      the tool task's GPU preset (pipeline-arith-tool-gpu: SFT -> multi-turn GRPO with a calculator -> test)
#   all       tests bench kernels pipeline seeds tool
#   e2e       scripts/bench/e2e.py: RL steps against their floors (RUNS, default "grpo-64 grpo-256 ppo-256") and
#             TRL's GRPOTrainer on the 64-sequence GRPO step (TRL_CONFIGS, default the script's; arguments after -- go to the
#             script; needs the `bench` extra: trl, datasets)
#   big       3 GRPO steps of a 7B-class actor with a reference on one GPU, the optimizer state on the host
#             (FRACTION=actor_optim.cpu_offload_fraction, default 1.0); with LORA_RANK=r a LoRA actor of
#             rank r on all linears instead (its base is the reference; FRACTION default 0)
#
# Environment:
#   PYTHON      the interpreter (default: python3 of the active environment)
#   OUT         the results folder when -o is not given (default: ./gpu-out)
#   WORK        checkpoints, runs and the model cache stay here (default: ${TMPDIR:-/tmp}/megatron-rlhf-gpu)
#   WHEELS      a folder of wheels to install offline when the package is not importable (default: .whl)
#   FLASHINFER_WHEELS  FlashInfer's carry (scripts/bench/flashinfer_carry.py), installed with $WHEELS when
#               FlashInfer is not importable and the folder is there (default: .whl-fi); its ahead-of-time
#               sampling module goes into the install and FlashInfer's JIT is turned off
# The package and its dependencies are used from the active environment when they import; otherwise they are
# installed: from $WHEELS without the network where that folder exists, else `pip install -e '.[test]'`.
set -uo pipefail

usage() { sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit "${1:-2}"; }
out=${OUT:-gpu-out}
stages=()
e2e_args=()
while [ $# -gt 0 ]; do
  case $1 in
    -o|--out) [ $# -ge 2 ] || usage; out=$2; shift 2;;
    -h|--help) usage 0;;
    --) shift; e2e_args=("$@"); break;;
    tests|bench|kernels|pipeline|seeds|tool|e2e|big) stages+=("$1"); shift;;
    all) stages+=(tests bench kernels pipeline seeds tool); shift;;
    *) echo "unknown stage or option '$1'" >&2; usage;;
  esac
done
[ ${#stages[@]} -gt 0 ] || stages=(tests bench kernels pipeline seeds tool)
wants() { [[ " ${stages[*]} " == *" $1 "* ]]; }

cd "$(dirname "$0")/.." || exit 1
mkdir -p "$out" || exit 1
out=$(cd "$out" && pwd)
python=${PYTHON:-python3}
work=${WORK:-${TMPDIR:-/tmp}/megatron-rlhf-gpu}
mkdir -p "$work" || exit 1
export PYTHONUNBUFFERED=1
export MEGATRON_RLHF_CACHE=${MEGATRON_RLHF_CACHE:-$work/cache}
# NVLink SHARP (multicast) needs a fabric set-up that not every machine has: off unless asked for.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}

# Set-up: the working tree's package, on the active environment's dependencies or installed ones.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! "$python" -c "import megatron_rlhf, megatron.core, pytest" 2>/dev/null; then
  wheels=${WHEELS:-.whl}
  if [ -d "$wheels" ]; then
    echo "installing the wheels of $wheels into $work/site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$wheels"/*.whl || exit 1
    export PYTHONPATH=$work/site:$PYTHONPATH
  else
    echo "installing the package and its test dependencies (pip install -e '.[test]')"
    "$python" -m pip install -q -e ".[test]" || exit 1
  fi
fi
flashinfer_wheels=${FLASHINFER_WHEELS:-.whl-fi}
if [ -d "$flashinfer_wheels" ] && ! "$python" -c "import flashinfer" 2>/dev/null; then
  echo "installing FlashInfer from $flashinfer_wheels into $work/site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$flashinfer_wheels"/*.whl || exit 1
  export PYTHONPATH=$work/site:$PYTHONPATH PATH=$work/site/bin:$PATH
  if [ -d "$flashinfer_wheels/aot" ]; then
    cp -r "$flashinfer_wheels/aot" "$work/site/flashinfer/data/" || exit 1
    export FLASHINFER_DISABLE_JIT=1
  fi
fi
if ! ngpu=$("$python" -c "import torch; assert torch.cuda.is_available(); print(torch.cuda.device_count())"); then
  echo "no CUDA device is visible to $python (torch.cuda.is_available() is False)" >&2
  exit 1
fi
{
  echo "$ngpu GPU(s); $("$python" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)")"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  fi
} | tee "$out/gpu.txt"

status=0
quiet() { grep -v "Warning\|warn"; }
torchrun() { "$python" -m torch.distributed.run --standalone --nproc-per-node="$1" "${@:2}"; }
bench() {  # name, lines of output to keep, command...
  local name=$1 keep=$2; shift 2
  "$@" 2>&1 | tail -"$keep" | tee "$out/bench_$name.log" || status=1
}
pipeline() {  # preset, seed, extra overrides...
  local preset=$1 seed=$2 runs=$work/pipeline-runs; shift 2
  local name=$preset-seed$seed
  "$python" -m megatron_rlhf pipeline --config "$preset" seed="$seed" output_dir="$runs/$name" "$@" \
    2>&1 | quiet | tee "$out/$name.log" | grep -E "^(pipeline|test|  |step [0-9]+/[0-9]+ \|)" || status=1
  (cd "$runs" && find "$name" \( -name metrics.jsonl -o -name curves.png -o -name result.json \
    -o -name pipeline.json -o -name summary.json -o -path "*/test/*.jsonl" \) -print0 | xargs -0 tar cf - \
    | tar xf - -C "$out")
}

if wants tests; then
  read -ra test_paths <<< "${TESTS:-tests}"
  "$python" -m pytest -m gpu "${test_paths[@]}" -v -s -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" || status=1
fi
if wants bench; then
  model=builtin:llama-1.5b
  bench load_tp1 25 torchrun 1 scripts/bench/load.py --model "$model" --tp 1 --out "$out/bench_load_tp1.json"
  bench update 80 torchrun 1 scripts/bench/update.py --model "$model" --profile --out "$out/bench_update.json"
  bench rollout 40 torchrun 1 scripts/bench/rollout.py --model "$model" --profile --out "$out/bench_rollout.json"
  bench checkpoint 5 "$python" scripts/bench/checkpoint.py --model "$model" --dir "$work/bench_checkpoint"
  # To a file:// folder: moto (--target s3) assembles a 25 GB object in memory and fails.
  bench remote_upload 3 "$python" scripts/bench/remote_upload.py --model "$model" --dir "$work/bench_remote" --target file \
    --out "$out/bench_remote_upload.json"
  bench host 12 "$python" scripts/bench/host.py --model "$model"
  bench lora_merge 1 torchrun 1 scripts/bench/lora_merge.py --model "$model" --rank 32 --out "$out/bench_lora_merge.json"
  bench multi_turn 1 torchrun 1 scripts/bench/multi_turn.py --model "$model" --out "$out/bench_multi_turn.json"
  if [ "$ngpu" -ge 2 ]; then
    bench load_tp2 25 torchrun 2 scripts/bench/load.py --model "$model" --tp 2 --out "$out/bench_load_tp2.json"
    bench reshard 25 torchrun 2 scripts/bench/rollout.py --model "$model" --out "$out/bench_reshard.json"
  fi
fi
if wants kernels; then
  bench decode_kernels 40 "$python" scripts/bench/decode_kernels.py --out "$out/bench_decode_kernels.json"
  bench swiglu 10 "$python" scripts/bench/swiglu.py --out "$out/bench_swiglu.json"
  bench train_kernels 40 "$python" scripts/bench/train_kernels.py --out "$out/bench_train_kernels.json"
fi
if wants pipeline; then
  pipeline pipeline-arith-gpu 1
fi
if wants seeds; then
  for seed in 2 3; do
    pipeline pipeline-arith-gpu "$seed" "stages=[grpo,ppo,test]" \
      sft.output_dir="$work/pipeline-runs/pipeline-arith-gpu-seed1/sft" \
      rm.output_dir="$work/pipeline-runs/pipeline-arith-gpu-seed1/rm"
  done
fi
if wants tool; then
  pipeline pipeline-arith-tool-gpu 1
fi
if wants e2e; then
  read -ra runs <<< "${RUNS:-grpo-64 grpo-256 ppo-256}"
  read -ra trl_configs <<< "${TRL_CONFIGS:-}"
  "$python" scripts/bench/e2e.py --runs "${runs[@]}" --work-dir "$work/bench_e2e" --out "$out/bench_e2e.json" \
    ${trl_configs[@]+--trl-configs "${trl_configs[@]}"} ${e2e_args[@]+"${e2e_args[@]}"} 2>&1 | quiet \
    | tee "$out/bench_e2e.log" || status=1
  cp "$work"/bench_e2e/*.log "$out/" 2>/dev/null
fi
if wants big; then  # the first run writes the random 7B checkpoint (15 GB) into the cache
  free -g | tee "$out/host.txt"
  (while sleep 5; do
    echo "$(date +%T) host used $(free -m | awk '/Mem:/{print $3}') MiB," \
      "gpu used $(nvidia-smi --query-gpu=memory.used --format=csv,noheader -i 0)"
  done) > "$out/big_memory.log" &
  sampler=$!
  lora_rank=${LORA_RANK:-0}
  if [ "$lora_rank" -gt 0 ]; then fraction=${FRACTION:-0.0}; else fraction=${FRACTION:-1.0}; fi
  "$python" -m megatron_rlhf ppo --config ppo-tiny actor.path=builtin:llama-7b reference.path=builtin:llama-7b \
    data.max_prompt_length=128 rollout.sampling.max_new_tokens=256 rollout.sampling.n=4 prompts_per_step=16 \
    mini_batch_size=16 max_steps=3 max_tokens_per_micro_batch=4096 log_every=1 save_hf=false save_final=false \
    actor.lora.rank="$lora_rank" actor_optim.cpu_offload_fraction="$fraction" \
    output_dir="$work/big-run" resume=never overwrite=true \
    2>&1 | quiet | tee "$out/big_7b.log" || status=1
  kill "$sampler"
  cp "$work/big-run/metrics.jsonl" "$out/big_7b_metrics.jsonl"
  sort -k4 -n "$out/big_memory.log" | tail -1 | sed 's/^/highest host use: /'
fi
echo "results in $out"
exit $status
