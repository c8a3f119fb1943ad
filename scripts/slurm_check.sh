#!/usr/bin/env bash
# Checks launch/slurm/multinode.sbatch against a real Slurm started on this machine, as root, without
# systemd or cgroups: munged, slurmctld and two slurmd ("node1", "node2", both localhost), all in a
# temporary folder with a generated slurm.conf, stopped on exit. Submits the template itself (its GPU
# lines overridden on the sbatch command line) with a tiny CPU SFT run:
#   (a) one node, two processes;  (b) two nodes, one process each;
#   (c) as (a), with a 3-minute limit and --signal=B:USR1@N, N such that the signal lands in the
#       middle of the time (a) spent training (Slurm's signal comes within 30 s), and REMOTE_DIR set:
#       the trainers save, upload the checkpoint and exit, and the job requeues itself; an Epilog
#       (node-local scratch, simulated) moves the stopped run's folder away before the requeued run
#       starts. That run must download the checkpoint from remote storage, resume from it and finish;
#       the remote `latest` must name the final step and the final weights equal (a)'s, bit for bit.
#       Remote storage: moto's S3 server on localhost (tests/s3_server.py; endpoint and credentials
#       reach the job in the AWS_* environment that sbatch exports) when boto3, moto, s3fs and pytest
#       import in PYTHON, else a file:// folder; the check says which.
# Takes 4-5 minutes on two CPU cores (more under load). Needs the slurm-wlm and munge packages:
# without them it prints "skipped: ..." and exits 0, unless SLURM_CHECK_INSTALL=1 (then it installs
# them with apt-get).
# Env: PYTHON (default .venv/bin/python if present, else python3), SLURM_CHECK_STEPS (steps of the
# (a)/(c) run, default 500: their training must last well over 30 s), SLURM_CHECK_KEEP=1 (keep the
# temporary folder for inspection).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STEPS="${SLURM_CHECK_STEPS:-500}"
say() { echo "slurm_check: $*"; }

missing() { for cmd in munged mungekey slurmctld slurmd sbatch scontrol; do command -v "$cmd" >/dev/null || return 0; done; return 1; }
if missing; then
  if [[ "${SLURM_CHECK_INSTALL:-0}" == 1 && "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    say "installing slurm-wlm and munge (SLURM_CHECK_INSTALL=1)"
    # A fresh machine may have no package lists yet: update them once if the install fails.
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null; then
      apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null \
        || { say "skipped: apt-get could not install slurm-wlm and munge"; exit 0; }
    fi
  else
    say "skipped: slurm-wlm/munge are not installed (SLURM_CHECK_INSTALL=1 installs them with apt-get, as root)"
    exit 0
  fi
fi
if [[ "$(id -u)" != 0 ]]; then
  say "skipped: needs root (slurmd runs the jobs as their user; munged runs as the munge user)"
  exit 0
fi
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHON

TMP="$(mktemp -d /tmp/slurm_check.XXXXXX)"
pids=()
job_ids=()
cleanup() {
  local pid
  # Jobs still running (a failed or timed-out check) end before the daemons that track them.
  if ((${#job_ids[@]})); then
    scancel "${job_ids[@]}" 2>/dev/null || true
    for _ in $(seq 45); do [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break; sleep 1; done
  fi
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  if [[ "${SLURM_CHECK_KEEP:-0}" == 1 ]]; then say "kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
start=$SECONDS

# --- remote storage for (c): started first, so that it comes up while Slurm does ---
# The helper writes the environment (c) is submitted with to $TMP/remote/env once the server is up;
# SIGTERM (cleanup) makes it leave s3_server.start's block, which stops moto.
mkdir -p "$TMP/remote"
if "$PYTHON" -c 'import boto3, moto.server, pytest, s3fs' 2>/dev/null; then
  remote_kind="moto's S3 server on localhost (tests/s3_server.py, authentication on)"
  "$PYTHON" - "$ROOT" "$TMP/remote" >"$TMP/remote/helper.out" 2>&1 <<'PY' &
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1])
from tests import s3_server

signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
folder = Path(sys.argv[2])
with s3_server.start(folder / "moto.log") as server:
    lines = [f"{key}={value}\n" for key, value in server.env().items()]
    lines.append(f"REMOTE_DIR=s3://{s3_server.BUCKET}/preempted\n")
    (folder / "env.part").write_text("".join(lines))
    (folder / "env.part").rename(folder / "env")
    while True:
        time.sleep(3600)
PY
  s3_pid=$!
  pids+=("$s3_pid")
else
  s3_pid=""
  remote_kind="a file:// folder (boto3, moto, s3fs or pytest is missing in $PYTHON)"
  echo "REMOTE_DIR=file://$TMP/remote/preempted" > "$TMP/remote/env"
fi

# --- munge: its own key and socket, so that a munged already running here is left alone ---
chmod 755 "$TMP"                                           # munged (not root) reaches its folder
mkdir -p "$TMP/munge" "$TMP/state" "$TMP/logs" "$TMP/runs" "$TMP/wiped" "$TMP/spool-node1" "$TMP/spool-node2"
mungekey --create --keyfile="$TMP/munge/munge.key"
chown -R munge: "$TMP/munge"
chmod 755 "$TMP/munge"                                     # munged: a socket everyone can reach
chmod 400 "$TMP/munge/munge.key"
runuser -u munge -- munged --foreground --key-file="$TMP/munge/munge.key" --socket="$TMP/munge/munge.socket" \
  --pid-file="$TMP/munge/munged.pid" --log-file="$TMP/munge/munged.log" --seed-file="$TMP/munge/munged.seed" \
  >"$TMP/munged.out" 2>&1 &
pids+=($!)

# --- slurm.conf: two nodes on localhost, no accounting, quick scheduling ---
# Below Linux's ephemeral ports (32768 and up), which any outgoing connection may hold: a draw in
# that range once found slurmd's port taken ("Address already in use": the nodes never came up).
port=$((20000 + RANDOM % 12000))
cat > "$TMP/slurm.conf" <<CONF
ClusterName=check
SlurmctldHost=localhost
SlurmctldPort=$port
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$TMP/munge/munge.socket,cred_expire=10
StateSaveLocation=$TMP/state
SlurmdSpoolDir=$TMP/spool-%n
SlurmctldPidFile=$TMP/slurmctld.pid
SlurmdPidFile=$TMP/slurmd-%n.pid
SlurmctldLogFile=$TMP/slurmctld.log
SlurmdLogFile=$TMP/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
Epilog=$TMP/epilog.sh
NodeName=node1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((port + 1)) CPUs=2 State=UNKNOWN
NodeName=node2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((port + 2)) CPUs=2 State=UNKNOWN
PartitionName=check Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$TMP/slurm.conf"
# Node-local scratch, simulated for (c): slurmd runs the Epilog as root on the job's node each time a
# job ends, at a requeue too, and the job stays COMPLETING (its requeued run waits) until it returns.
# It moves (c)'s folder to $TMP/wiped/ when the run in it has not finished (no result.json: the stop
# before the requeue), so the requeued run finds no local checkpoint. A finished run's folder stays
# where the other jobs' are, for the checks below. The epilog gets no PATH and no job name: (c)'s job
# id is written to $TMP/scratch-job once submitted. It always exits 0 (a failing epilog drains the node).
{ echo '#!/bin/bash'; printf 'TMP=%q\n' "$TMP"; cat <<'EPILOG'; } > "$TMP/epilog.sh"
PATH=/usr/bin:/bin
run="$TMP/runs/preempted"
if [[ "${SLURM_JOB_ID:-}" == "$(cat "$TMP/scratch-job" 2>/dev/null)" && -d "$run" && ! -f "$run/result.json" ]]; then
  to="$TMP/wiped/preempted.${SLURM_JOB_RESTART_COUNT:-0}"
  mv "$run" "$to" && echo "$(date +%T) job $SLURM_JOB_ID ended unfinished: moved $run to $to" >> "$TMP/epilog.log"
fi
exit 0
EPILOG
chmod 755 "$TMP/epilog.sh"

for _ in $(seq 50); do [[ -S "$TMP/munge/munge.socket" ]] && break; sleep 0.1; done
[[ -S "$TMP/munge/munge.socket" ]] || { cat "$TMP/munged.out"; say "FAILED: munged did not start"; exit 1; }
slurmctld -D -c -f "$SLURM_CONF" >"$TMP/slurmctld.out" 2>&1 &
pids+=($!)
for node in node1 node2; do
  slurmd -D -N "$node" -f "$SLURM_CONF" >"$TMP/slurmd-$node.out" 2>&1 &
  pids+=($!)
done
deadline=$((SECONDS + 60))
until [[ "$(sinfo -h -o %t 2>/dev/null | sort -u)" == idle ]]; do
  ((SECONDS < deadline)) || { sinfo || true; tail -n 20 "$TMP"/*.log; say "FAILED: the nodes did not come up"; exit 1; }
  sleep 1
done
say "slurm up in $((SECONDS - start)) s: $(sinfo -h -o '%P %D nodes %t' | head -n1)"
deadline=$((SECONDS + 60))
until [[ -f "$TMP/remote/env" ]]; do
  ((SECONDS < deadline)) && kill -0 "$s3_pid" 2>/dev/null || { tail -n 20 "$TMP/remote/helper.out" "$TMP/remote/moto.log" || true; say "FAILED: the S3 server did not start"; exit 1; }
  sleep 0.5
done
remote_env=()
while IFS= read -r line; do remote_env+=("$line"); done < "$TMP/remote/env"
say "remote storage for (c): $remote_kind"

# --- the runs ---
"$PYTHON" - "$TMP/train.jsonl" <<'PY'
import json, random, sys
rng = random.Random(0)
words = "apple bird cat dog egg fish goat hat ink jam kite lamp".split()
with open(sys.argv[1], "w") as f:
    for _ in range(256):
        w = [rng.choice(words) for _ in range(rng.randint(3, 6))]
        f.write(json.dumps({"prompt": " ".join(w) + " =", "response": " " + " ".join(reversed(w))}) + "\n")
PY
SFT=(sft --config sft-tiny "data.train=[$TMP/train.jsonl]" log_every=20)

# submit NAME PROCESSES_PER_NODE SBATCH_OPTION... -- ARGS...: prints the job id
submit() {
  local name="$1" procs="$2"; shift 2
  local opts=()
  while [[ "$1" != -- ]]; do opts+=("$1"); shift; done
  shift
  (cd "$ROOT" && GPUS_PER_NODE="$procs" MASTER_ADDR=127.0.0.1 OUTPUT_DIR="$TMP/runs/$name" \
     sbatch --parsable --job-name="$name" --output="$TMP/logs/%x.out" --gpus-per-node=0 \
       --cpus-per-task=2 "${opts[@]}" launch/slurm/multinode.sbatch "$@")
}
field() { scontrol show job "$1" -o | tr ' ' '\n' | sed -n "s/^$2=//p"; }
# wait_job ID SECONDS: waits until the job has ended for good
wait_job() {
  local deadline=$((SECONDS + $2)) state
  while ((SECONDS < deadline)); do
    state="$(field "$1" JobState)"
    case "$state" in COMPLETED|FAILED|TIMEOUT|CANCELLED|NODE_FAIL|OUT_OF_MEMORY|PREEMPTED|BOOT_FAIL|DEADLINE) return 0 ;; esac
    sleep 2
  done
  return 1
}
failures=0
summary=()
# check NAME JOB_ID DETAIL: the job completed, exit 0, and its run wrote result.json
check() {
  local name="$1" id="$2" state code
  state="$(field "$id" JobState)" code="$(field "$id" ExitCode)"
  if [[ "$state" == COMPLETED && "$code" == 0:0 && -f "$TMP/runs/$name/result.json" ]]; then
    summary+=("ok    $name: job $id $state on $(field "$id" NodeList), restarts $(field "$id" Restarts), $3")
  else
    summary+=("FAIL  $name: job $id $state exit $code$([[ -f "$TMP/runs/$name/result.json" ]] || echo ', no result.json'); log $TMP/logs/$name.out")
    failures=$((failures + 1))
    SLURM_CHECK_KEEP=1
  fi
}

t=$SECONDS
id_a="$(submit one-node 2 --nodes=1 -- "${SFT[@]}" max_steps="$STEPS")"
job_ids+=("$id_a")
# When this run trains (its first metrics line to its exported model), in seconds from the job's
# start: (c)'s signal is aimed at the middle of that window, whatever the machine's load.
train_from="" train_to=""
deadline=$((SECONDS + 300))
until wait_job "$id_a" 1; do
  ((SECONDS < deadline)) || { say "one-node: still running after 300 s"; break; }
  [[ -n "$train_from" || ! -s "$TMP/runs/one-node/metrics.jsonl" ]] || train_from=$(date +%s)
  [[ -n "$train_to" || ! -f "$TMP/runs/one-node/hf/config.json" ]] || train_to=$(date +%s)
done
check one-node "$id_a" "2 processes, $STEPS steps in $((SECONDS - t)) s"

t=$SECONDS
id_b="$(submit two-nodes 1 --nodes=2 -- "${SFT[@]}" max_steps=10)"
job_ids+=("$id_b")
wait_job "$id_b" 200 || say "two-nodes: still running after 200 s"
check two-nodes "$id_b" "1 process per node, 10 steps in $((SECONDS - t)) s"

t=$SECONDS
# Slurm looks at time limits every 30 s: --signal=B:USR1@N comes N to N+30 s before the 180 s limit.
started="$(date -d "$(field "$id_a" StartTime)" +%s)"
mid=$(( (${train_from:-$started} + ${train_to:-$started} - 2 * started) / 2 ))
lead=$((180 - 15 - mid))
((lead > 0 && lead < 150)) || lead=90
say "one-node trained from $((${train_from:-0} - started)) s to $((${train_to:-0} - started)) s: (c) gets USR1 $((180 - lead - 30))-$((180 - lead)) s in"
# REMOTE_DIR and the storage's endpoint and credentials reach the job in the environment sbatch exports.
export "${remote_env[@]}"
id_c="$(submit preempted 2 --nodes=1 --time=3 --signal=B:USR1@"$lead" -- "${SFT[@]}" max_steps="$STEPS")"
job_ids+=("$id_c")
echo "$id_c" > "$TMP/scratch-job"
# Once requeued the job gets a longer limit, so that one stop is enough to finish.
deadline=$((SECONDS + 420))
until wait_job "$id_c" 2; do
  ((SECONDS < deadline)) || { say "preempted: still running after 420 s"; break; }
  if [[ "$(field "$id_c" Restarts)" -ge 1 && "$(field "$id_c" TimeLimit)" != 00:10:00 ]]; then
    scontrol update JobId="$id_c" TimeLimit=10
  fi
done
log_c="$TMP/logs/preempted.out"
resumed="$(grep -o 'resumed from .* at step [0-9]*' "$log_c" | head -n1 | grep -o '[0-9]*$' || true)"
check preempted "$id_c" "USR1, saved at step ${resumed:-?}, requeued, resumed, finished: $((SECONDS - t)) s in all"
if ! grep -q "SIGUSR1 received" "$log_c" || ! grep -q "requeueing job $id_c" "$log_c" || [[ -z "$resumed" ]]; then
  summary+=("FAIL  preempted: expected USR1 to reach the trainers, a requeue and a resumed run; log $log_c")
  failures=$((failures + 1)); SLURM_CHECK_KEEP=1
fi
# The requeued run found no local folder (the epilog had moved the stopped run's, with the checkpoint
# it saved), downloaded that step from REMOTE_DIR and resumed from it; the remote `latest` names the
# final step.
downloaded="$(grep -o "downloaded $REMOTE_DIR/step_[0-9]* to " "$log_c" | head -n1 | sed 's/.*step_\([0-9]*\) to $/\1/' || true)"
remote_latest="$(cd "$ROOT" && "$PYTHON" -c 'import sys
from megatron_rlhf.checkpoint.remote import RemoteDir
print(RemoteDir(sys.argv[1]).latest())' "$REMOTE_DIR" 2>"$TMP/remote/latest.err" || true)"
if [[ -n "$resumed" && "$downloaded" == "$resumed" && -d "$TMP/wiped/preempted.1/checkpoints/step_$resumed" \
      && "$remote_latest" == "$STEPS" ]]; then
  summary+=("ok    preempted: folder moved away at the requeue, step $resumed downloaded from $REMOTE_DIR, remote latest step_$remote_latest")
else
  summary+=("FAIL  preempted: expected the requeued run to download step ${resumed:-?} from $REMOTE_DIR (downloaded: ${downloaded:-none}; epilog log: $TMP/epilog.log) and the remote latest to be step_$STEPS (${remote_latest:-unreadable}); log $log_c")
  failures=$((failures + 1)); SLURM_CHECK_KEEP=1
fi
if "$PYTHON" - "$TMP/runs/one-node/hf" "$TMP/runs/preempted/hf" <<'PY'
import sys
from pathlib import Path
from safetensors.torch import load_file
a, b = ({k: v for f in sorted(Path(d).glob("*.safetensors")) for k, v in load_file(f).items()} for d in sys.argv[1:])
sys.exit(0 if a and a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a) else 1)
PY
then
  summary+=("ok    preempted and requeued run's final weights == uninterrupted one-node run's")
else
  summary+=("FAIL  preempted and requeued run's final weights differ from the uninterrupted run's (or are missing)")
  failures=$((failures + 1)); SLURM_CHECK_KEEP=1
fi

say "summary ($((SECONDS - start)) s):"
printf '  %s\n' "${summary[@]}"
if ((failures)); then say "FAILED: $failures problem(s)"; exit 1; fi
say "passed"
