#!/usr/bin/env bash
# Build and run the megatron-rlhf image.
#   launch/docker.sh build [DOCKER_BUILD_ARGS...]    e.g. --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
#   launch/docker.sh run [--nproc N] SUBCOMMAND [ARGS...]   runs launch/torchrun.sh inside the image
# Env: IMAGE (default megatron-rlhf:latest), DOCKER_RUN_ARGS (extra `docker run` flags, word-split).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${IMAGE:-megatron-rlhf:latest}"
WORKDIR=/workspace/megatron-rlhf

usage() { sed -n '2,5p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

case "${1:-}" in
  build)
    shift
    exec docker build -t "$IMAGE" -f "$ROOT/Dockerfile" "$@" "$ROOT"
    ;;
  run)
    shift
    [[ $# -gt 0 ]] || { echo "launch/docker.sh run: missing SUBCOMMAND" >&2; exit 2; }
    tty_flags=()
    [[ -t 0 && -t 1 ]] && tty_flags=(-it)
    read -r -a extra <<< "${DOCKER_RUN_ARGS:-}"
    # The checkout is mounted over the image's copy (the editable install points there), so
    # local edits run without a rebuild. PYTHON=python: never the host .venv that comes with it.
    exec docker run --rm "${tty_flags[@]}" --gpus all --ipc=host \
      --ulimit memlock=-1 --ulimit stack=67108864 \
      -v "$ROOT:$WORKDIR" -w "$WORKDIR" -e PYTHON=python \
      "${extra[@]}" "$IMAGE" launch/torchrun.sh "$@"
    ;;
  -h|--help) usage ;;
  *) usage >&2; exit 2 ;;
esac
