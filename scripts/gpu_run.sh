#!/usr/bin/env bash
# On the lent GPU machine: install carried wheels, run the GPU test tier, run benchmarks.
# Results (logs, JSON) go to $OUT (the device tool's output folder), or ./gpu-out elsewhere.
#   device run, carry [.whl]:  bash scripts/gpu_run.sh [all|tests|bench]
# All of it takes about 10 minutes on nvidia-h200-x2: more than one device call may run, so
# "tests" and "bench" split it in two.
set -uo pipefail
stage=${1:-all}
case $stage in all|tests|bench) ;; *) echo "usage: $0 [all|tests|bench] (got '$stage')" >&2; exit 2;; esac
cd "$(dirname "$0")/.."
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
if [ "$stage" != bench ]; then
  python3 -m pytest -m gpu tests/gpu -q -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" || status=1
fi
[ "$stage" = tests ] && exit $status
bench() { python3 -m torch.distributed.run --standalone --nproc-per-node="$1" "${@:2}"; }
bench 1 scripts/bench_load.py --model builtin:llama-1.5b --tp 1 --out "$OUT/bench_load_tp1.json" 2>&1 | tail -25 | tee "$OUT/bench_load_tp1.log" || status=1
bench 1 scripts/bench_update.py --model builtin:llama-1.5b --out "$OUT/bench_update.json" 2>&1 | tail -30 | tee "$OUT/bench_update.log" || status=1
bench 1 scripts/bench_rollout.py --model builtin:llama-1.5b --profile --out "$OUT/bench_rollout.json" 2>&1 | tail -40 | tee "$OUT/bench_rollout.log" || status=1
if [ "$ngpu" -ge 2 ]; then
  bench 2 scripts/bench_load.py --model builtin:llama-1.5b --tp 2 --out "$OUT/bench_load_tp2.json" 2>&1 | tail -25 | tee "$OUT/bench_load_tp2.log" || status=1
  bench 2 scripts/bench_rollout.py --model builtin:llama-1.5b --out "$OUT/bench_reshard.json" 2>&1 | tail -25 | tee "$OUT/bench_reshard.log" || status=1
fi
exit $status
