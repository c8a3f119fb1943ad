#!/usr/bin/env bash
# On the lent GPU machine: install carried wheels, run the GPU test tier, run benchmarks.
# Results (logs, JSON) go to $OUT (the device tool's output folder), or ./gpu-out elsewhere.
#   device run, carry [.whl]:  bash scripts/gpu_run.sh [all|tests|bench|pipeline|seeds|big|e2e]
# All of it takes more than one device call (10 minutes at most), so it splits: "tests" (the GPU
# tier), "bench" (benchmarks), "pipeline" (the GPU preset of `megatron-rlhf pipeline`, seed 1) and
# "seeds" (its RL stages again with seeds 2 and 3, from seed 1's SFT and reward model) and "big" (3 GRPO
# steps of a 7B-class actor with a reference on one GPU, the optimizer state on the host:
# FRACTION=actor_optim.cpu_offload_fraction, default 1.0; not part of "all"), "e2e" (scripts/bench_e2e.py:
# our GRPO step, its floor and TRL's GRPOTrainer on the same shape; SEQUENCES=64|256, default 64;
# TRL_CONFIGS, default the script's; extra arguments go to the script; .whl must hold trl, datasets,
# dill and multiprocess; not part of "all").
set -uo pipefail
stage=${1:-all}
case $stage in all|tests|bench|pipeline|seeds|big|e2e) ;; *) echo "usage: $0 [all|tests|bench|pipeline|seeds|big|e2e] (got '$stage')" >&2; exit 2;; esac
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export MEGATRON_RLHF_CACHE=/tmp/mrlhf-cache
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
status=0
RUNS=${RUNS:-/tmp/pipeline-runs}  # checkpoints and exports stay on the machine; figures go to $OUT
pipeline() {  # seed, extra overrides...
  local seed=$1; shift
  python3 -m megatron_rlhf pipeline --config pipeline-arith-gpu seed="$seed" output_dir="$RUNS/seed$seed" "$@" \
    2>&1 | grep -v "Warning\|warn" | tee "$OUT/pipeline_seed$seed.log" | grep -E "^(pipeline|test|  |step [0-9]+/[0-9]+ \|)" || status=1
  (cd "$RUNS" && find "seed$seed" \( -name metrics.jsonl -o -name curves.png -o -name result.json -o -name pipeline.json \
    -o -name summary.json -o -path "*/test/*.jsonl" \) -print0 | xargs -0 tar cf - | tar xf - -C "$OUT")
}
if [ "$stage" = big ]; then  # the first run writes the random 7B checkpoint (15 GB) into the cache
  free -g | tee "$OUT/host.txt"
  (while sleep 5; do echo "$(date +%T) host used $(free -m | awk '/Mem:/{print $3}') MiB," \
    "gpu used $(nvidia-smi --query-gpu=memory.used --format=csv,noheader -i 0)"; done) > "$OUT/big_memory.log" &
  sampler=$!
  python3 -m megatron_rlhf ppo --config ppo-tiny actor.path=builtin:llama-7b reference.path=builtin:llama-7b \
    data.max_prompt_length=128 rollout.sampling.max_new_tokens=256 rollout.sampling.n=4 prompts_per_step=16 \
    mini_batch_size=16 max_steps=3 max_tokens_per_micro_batch=4096 log_every=1 save_hf=false save_final=false \
    actor_optim.cpu_offload_fraction="${FRACTION:-1.0}" output_dir=/tmp/big-run resume=never overwrite=true \
    2>&1 | grep -v "Warning\|warn" | tee "$OUT/big_7b.log" || status=1
  kill "$sampler"
  cp /tmp/big-run/metrics.jsonl "$OUT/big_7b_metrics.jsonl"
  sort -k4 -n "$OUT/big_memory.log" | tail -1 | sed 's/^/highest host use: /'
  exit $status
fi
if [ "$stage" = e2e ]; then
  seqs=${SEQUENCES:-64}
  # shellcheck disable=SC2086  # TRL_CONFIGS is a list of words
  python3 scripts/bench_e2e.py --sequences "$seqs" --work-dir /tmp/bench_e2e --out "$OUT/bench_e2e_$seqs.json" \
    ${TRL_CONFIGS:+--trl-configs $TRL_CONFIGS} "${@:2}" 2>&1 | grep -v "Warning\|warn" | tee "$OUT/bench_e2e_$seqs.log" || status=1
  cp /tmp/bench_e2e/*.log "$OUT/" 2>/dev/null
  exit $status
fi
if [ "$stage" = pipeline ] || [ "$stage" = all ]; then
  pipeline 1
fi
if [ "$stage" = seeds ] || [ "$stage" = all ]; then
  for seed in 2 3; do
    pipeline "$seed" "stages=[grpo,ppo,test]" sft.output_dir="$RUNS/seed1/sft" rm.output_dir="$RUNS/seed1/rm"
  done
fi
case $stage in pipeline|seeds) exit $status;; esac
if [ "$stage" != bench ]; then
  python3 -m pytest -m gpu tests/gpu -q -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" || status=1
fi
[ "$stage" = tests ] && exit $status
bench() { python3 -m torch.distributed.run --standalone --nproc-per-node="$1" "${@:2}"; }
bench 1 scripts/bench_load.py --model builtin:llama-1.5b --tp 1 --out "$OUT/bench_load_tp1.json" 2>&1 | tail -25 | tee "$OUT/bench_load_tp1.log" || status=1
bench 1 scripts/bench_update.py --model builtin:llama-1.5b --profile --out "$OUT/bench_update.json" 2>&1 | tail -80 | tee "$OUT/bench_update.log" || status=1
bench 1 scripts/bench_rollout.py --model builtin:llama-1.5b --profile --out "$OUT/bench_rollout.json" 2>&1 | tail -40 | tee "$OUT/bench_rollout.log" || status=1
python3 scripts/bench_checkpoint.py --model builtin:llama-1.5b --dir /tmp/bench_checkpoint 2>&1 | tail -5 | tee "$OUT/bench_checkpoint.log" || status=1
python3 scripts/bench_host.py --model builtin:llama-1.5b 2>&1 | tail -12 | tee "$OUT/bench_host.log" || status=1
if [ "$ngpu" -ge 2 ]; then
  bench 2 scripts/bench_load.py --model builtin:llama-1.5b --tp 2 --out "$OUT/bench_load_tp2.json" 2>&1 | tail -25 | tee "$OUT/bench_load_tp2.log" || status=1
  bench 2 scripts/bench_rollout.py --model builtin:llama-1.5b --out "$OUT/bench_reshard.json" 2>&1 | tail -25 | tee "$OUT/bench_reshard.log" || status=1
fi
exit $status
