#!/usr/bin/env bash
# Build and run the megatron-rlhf image.
#   launch/docker.sh build [BUILD_ARGS...]    e.g. --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:26.05-py3
#   launch/docker.sh run [LAUNCHER_OPTIONS] SUBCOMMAND [ARGS...]   launch/torchrun.sh inside the image (--nproc,
#                                             --nnodes with --rdzv-endpoint: see its --help)
#   launch/docker.sh health                   versions (the image's HEALTHCHECK), then a CPU smoke run
# Env: IMAGE (default megatron-rlhf:latest), DOCKER (default docker; podman works), GPUS (default all;
# empty: no --gpus, CPU only), SHM_SIZE (e.g. 64g: --shm-size instead of --ipc=host, where host IPC
# is not allowed), MOUNTS (comma-separated HOST:CONTAINER[:ro] volumes, e.g. /models:/models:ro),
# ULIMITS (default "memlock=-1 stack=67108864", NVIDIA's advice; word-split, each one --ulimit),
# NETWORK (--network; default host for `run --nnodes N`, where the rendezvous and NCCL must reach the
# other nodes, else docker's own; InfiniBand also needs e.g. DOCKER_RUN_ARGS="--device /dev/infiniband"),
# DOCKER_RUN_ARGS (extra `run` flags, word-split).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${IMAGE:-megatron-rlhf:latest}"
DOCKER="${DOCKER:-docker}"
WORKDIR=/workspace/megatron-rlhf

usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

# Flags shared by run and health: GPUs, shared memory (torch's DataLoader workers and NCCL need
# more than docker's 64 MB default), limits (pinned memory, stack), extra mounts.
run_flags() {
  flags=(--rm)
  [[ -t 0 && -t 1 ]] && flags+=(-it)
  [[ -n "${GPUS-all}" ]] && flags+=(--gpus "${GPUS-all}")
  if [[ -n "${SHM_SIZE:-}" ]]; then flags+=(--shm-size "$SHM_SIZE"); else flags+=(--ipc=host); fi
  local -a ulimits
  read -r -a ulimits <<< "${ULIMITS-memlock=-1 stack=67108864}"
  for ulimit in "${ulimits[@]}"; do flags+=(--ulimit "$ulimit"); done
  local -a mounts
  IFS=',' read -r -a mounts <<< "${MOUNTS:-}"
  for mount in "${mounts[@]}"; do flags+=(-v "$mount"); done
  local -a extra
  read -r -a extra <<< "${DOCKER_RUN_ARGS:-}"
  flags+=("${extra[@]}")
}

case "${1:-}" in
  build)
    shift
    exec "$DOCKER" build -t "$IMAGE" -f "$ROOT/Dockerfile" "$@" "$ROOT"
    ;;
  run)
    shift
    [[ $# -gt 0 ]] || { echo "launch/docker.sh run: missing SUBCOMMAND" >&2; exit 2; }
    run_flags
    # Several nodes: the container's own network would hide this node from the others.
    network=${NETWORK-}
    if [[ -z ${NETWORK+x} ]]; then
      for arg in "$@"; do
        if [[ $arg == --nnodes || $arg == --nnodes=* ]]; then network=host; fi
      done
    fi
    [[ -n "$network" ]] && flags+=(--network "$network")
    # The checkout is mounted over the image's copy (the editable install points there), so
    # local edits run without a rebuild. PYTHON=python: never the host .venv that comes with it.
    # As the host user, so that runs/ and caches written into the checkout stay theirs (HOME in
    # /tmp: the image has no home for that user; its caches are the container's).
    user=()
    [[ "$(id -u)" == 0 ]] || user=(--user "$(id -u):$(id -g)" -e HOME=/tmp)
    exec "$DOCKER" run "${flags[@]}" "${user[@]}" -v "$ROOT:$WORKDIR" -w "$WORKDIR" -e PYTHON=python \
      "$IMAGE" launch/torchrun.sh "$@"
    ;;
  health)
    run_flags
    exec "$DOCKER" run "${flags[@]}" "$IMAGE" megatron-rlhf smoke device=cpu output_dir=/tmp/megatron-rlhf-health
    ;;
  -h|--help) usage ;;
  *) usage >&2; exit 2 ;;
esac
