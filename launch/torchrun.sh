#!/usr/bin/env bash
# torchrun launcher: one node by default (--standalone); with --nnodes, this node's agent of a
# multi-node job (c10d rendezvous; run the same line on every node).
#   launch/torchrun.sh [--nproc N] [--nnodes N --rdzv-endpoint HOST:PORT [--rdzv-id ID]] [--dry-run] SUBCOMMAND [ARGS...]
# Everything from SUBCOMMAND on is handed to `python -m megatron_rlhf` untouched.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  cat <<USAGE
Usage: launch/torchrun.sh [--nproc N] [--nnodes N --rdzv-endpoint HOST:PORT [--rdzv-id ID]]
                          [--dry-run] SUBCOMMAND [ARGS...]

Runs: \$PYTHON -m torch.distributed.run --standalone --nproc-per-node=N -m megatron_rlhf SUBCOMMAND ARGS...
(with --nnodes: --nnodes=N --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=ID instead of --standalone)

Options:
  --nproc N                 processes on this node (default: visible GPUs, or 1 without GPUs: CPU/gloo)
  --nnodes N                nodes in the job; run this same line on each of them (no node rank needed)
  --rdzv-endpoint HOST:PORT rendezvous on HOST (e.g. the first node), reachable from every node
  --rdzv-id ID              job id shared by the nodes (default: megatron-rlhf)
  --dry-run                 print the command instead of running it
  -h, --help                show this help

Environment: PYTHON (default: the active virtual environment's python (\$VIRTUAL_ENV, then conda's
\$CONDA_PREFIX), else the repo's .venv/bin/python, else python3),
OMP_NUM_THREADS (default 1), NCCL_NVLS_ENABLE (default 0),
TORCH_SYMM_MEM_DISABLE_MULTICAST (default 1).
Examples: launch/torchrun.sh --nproc 2 ppo --config ppo-tiny actor.tp=2 rollout.tp=1
  on each of 2 nodes: launch/torchrun.sh --nnodes 2 --rdzv-endpoint node0:29500 --rdzv-id run1 ppo --config my-run.yaml actor.tp=8
USAGE
}

die() { echo "launch/torchrun.sh: $*" >&2; echo "Try 'launch/torchrun.sh --help'." >&2; exit 2; }

# Number of visible GPUs: CUDA_VISIBLE_DEVICES wins when set (empty or -1 means none).
count_gpus() {
  if [[ -n "${CUDA_VISIBLE_DEVICES+x}" ]]; then
    local cvd="${CUDA_VISIBLE_DEVICES// /}"
    if [[ -z "$cvd" || "$cvd" == -1* ]]; then echo 0; return; fi
    local -a ids
    IFS=',' read -r -a ids <<< "$cvd"
    echo "${#ids[@]}"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    # Count only "GPU n:" lines (MIG instances are listed indented below them).
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
  else
    echo 0
  fi
}

NPROC=""
NNODES=""
RDZV_ENDPOINT=""
RDZV_ID="megatron-rlhf"
DRY_RUN=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --nproc) [[ $# -ge 2 ]] || die "--nproc needs a value"; NPROC="$2"; shift 2 ;;
    --nproc=*) NPROC="${1#*=}"; shift ;;
    --nnodes) [[ $# -ge 2 ]] || die "--nnodes needs a value"; NNODES="$2"; shift 2 ;;
    --nnodes=*) NNODES="${1#*=}"; shift ;;
    --rdzv-endpoint) [[ $# -ge 2 ]] || die "--rdzv-endpoint needs a value"; RDZV_ENDPOINT="$2"; shift 2 ;;
    --rdzv-endpoint=*) RDZV_ENDPOINT="${1#*=}"; shift ;;
    --rdzv-id) [[ $# -ge 2 ]] || die "--rdzv-id needs a value"; RDZV_ID="$2"; shift 2 ;;
    --rdzv-id=*) RDZV_ID="${1#*=}"; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; break ;;
    -*) die "unknown option '$1' (launcher options go before the sub-command)" ;;
    *) break ;;
  esac
done
[[ $# -gt 0 ]] || die "missing SUBCOMMAND (ppo, sft, rm, pipeline, generate, plan, convert, smoke)"

if [[ -z "$NPROC" ]]; then
  NPROC="$(count_gpus)"
  [[ "$NPROC" -gt 0 ]] || NPROC=1  # no GPU: one CPU (gloo) process
fi
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || die "--nproc must be a positive integer, got '$NPROC'"

# One node: a private rendezvous. Several: every node's agent meets at the shared endpoint.
rdzv_args=(--standalone)
if [[ -n "$NNODES" ]]; then
  [[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "--nnodes must be a positive integer, got '$NNODES'"
  [[ -n "$RDZV_ENDPOINT" ]] || die "--nnodes needs --rdzv-endpoint HOST:PORT (the same on every node)"
  rdzv_args=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID")
elif [[ -n "$RDZV_ENDPOINT" ]]; then
  die "--rdzv-endpoint is for multi-node runs: give --nnodes too"
fi

# The interpreter: $PYTHON, else the environment the user activated (the one they installed into),
# else the repo's .venv (scripts/setup_env.sh makes it), else python3 from PATH.
if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=python3
  for candidate in "${VIRTUAL_ENV:-}" "${CONDA_PREFIX:-}" "$ROOT/.venv"; do
    if [[ -n "$candidate" && -x "$candidate/bin/python" ]]; then PYTHON="$candidate/bin/python"; break; fi
  done
fi

# One thread per rank unless asked otherwise (torchrun only warns about this).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# NVLink multicast (NVLS / symmetric-memory multicast) off by default.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
# Import the package from this checkout even when it is not pip-installed.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# --signals-to-handle: torchrun would otherwise install its own TERM and INT handlers (below).
cmd=("$PYTHON" -m torch.distributed.run "${rdzv_args[@]}" --nproc-per-node="$NPROC" "--signals-to-handle=SIGHUP,SIGQUIT"
     -m megatron_rlhf "$@")
if [[ "$DRY_RUN" == 1 ]]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
# Stop signals (Ctrl-C, TERM, USR1) go to the workers, once, from here: the trainers then save after
# the current step and exit (trainer/stop.py; a second signal ends them at once). torchrun, told of
# one itself, would pass it on, SIGKILL the workers 30 s later (often mid-checkpoint) and exit 1 with
# a traceback; so it runs with them ignored (its workers inherit that; the CLI restores INT and TERM,
# and a trainer takes all three as its run starts). Ctrl-C or a signal to the whole process group
# (docker stop, Slurm) reaches the workers directly too: the two copies count as one request. USR2
# counts as USR1: launch/slurm/multinode.sbatch passes its USR1 on as USR2, which no process of the
# job step then acts on by itself (Slurm may signal all of them).
command -v pkill >/dev/null || echo "launch/torchrun.sh: no pkill (procps): a stop signal cannot reach the trainers" >&2
( trap '' INT TERM USR1 USR2
  exec "${cmd[@]}" ) &
agent=$!
for sig in INT TERM USR1; do
  # shellcheck disable=SC2064  # $sig and $agent are meant to expand now
  trap "echo \"\$(hostname): $sig to the trainer processes\" >&2; pkill -$sig -P $agent || true" "$sig"
done
# shellcheck disable=SC2064
trap "echo \"\$(hostname): USR1 to the trainer processes\" >&2; pkill -USR1 -P $agent || true" USR2
# A trapped signal interrupts `wait`: wait again until torchrun has really ended.
rc=0
wait "$agent" || rc=$?
while kill -0 "$agent" 2>/dev/null; do
  rc=0
  wait "$agent" || rc=$?
done
exit "$rc"
