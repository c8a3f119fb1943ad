#!/usr/bin/env bash
# One node's part of a Slurm job (run by multinode.sbatch through srun, one task per node): torchrun
# with GPUS_PER_NODE processes and c10d rendezvous at MASTER_ADDR:MASTER_PORT, then
# `python -m megatron_rlhf ARGS...`. Nothing to edit here: the settings come from multinode.sbatch.
#
# Stopping: the trainers save and exit on USR1, but a signal Slurm sends to a job step reaches a
# varying set of its processes: every one with proctrack/cgroup, only the task's process group with
# proctrack/pgid (torchrun starts its workers in sessions of their own). So the batch script sends
# USR2, which torchrun and its workers ignore, and this script turns it into exactly one USR1 per
# worker. torchrun ignores USR1 too: left to itself it would die of it (or, told to forward it, kill
# the workers 30 s later, often in the middle of their checkpoint).
set -euo pipefail
command -v pkill >/dev/null || echo "$(hostname): no pkill (procps): a stop signal cannot reach the trainers" >&2

# Ignored signals stay ignored across exec: torchrun and its workers inherit this (the trainer
# installs its own USR1 handler while it trains).
( trap '' USR1 USR2
  exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$SLURM_NNODES" --nproc-per-node="$GPUS_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \
    -m megatron_rlhf "$@" ) &
agent=$!
# torchrun's children are its workers. USR1 sent to the job step itself (scancel --signal=USR1 without
# -b) is forwarded the same way: untrapped, it would end this shell, and with it the step, while the
# trainers save. Where the workers got it directly too (proctrack/cgroup), the two copies arrive at
# once and count as one request (trainer/stop.py).
trap 'echo "$(hostname): USR1 to the trainer processes"; pkill -USR1 -P "$agent" || true' USR1 USR2

# A trapped signal interrupts `wait`: wait again until torchrun has really ended.
rc=0
wait "$agent" || rc=$?
while kill -0 "$agent" 2>/dev/null; do
  rc=0
  wait "$agent" || rc=$?
done
exit "$rc"
