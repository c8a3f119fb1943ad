#!/usr/bin/env bash
# One node's part of a Slurm job (run by multinode.sbatch through srun, one task per node):
# launch/torchrun.sh with GPUS_PER_NODE processes and c10d rendezvous at MASTER_ADDR:MASTER_PORT, then
# `python -m megatron_rlhf ARGS...`. Nothing to edit here: the settings come from multinode.sbatch.
#
# Stopping: the trainers save and exit on USR1, but a signal Slurm sends to a job step reaches a
# varying set of its processes: every one with proctrack/cgroup, only the task's process group with
# proctrack/pgid (torchrun starts its workers in sessions of their own). So the batch script sends
# USR2, which torchrun and its workers ignore, and launch/torchrun.sh turns it into exactly one USR1
# per worker (it passes USR1, TERM and INT on the same way: where a worker also got one directly, the
# two copies arrive at once and count as one request, trainer/stop.py).
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/../torchrun.sh" --nproc "$GPUS_PER_NODE" --nnodes "$SLURM_NNODES" \
  --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" "$@"
