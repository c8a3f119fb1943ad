#!/usr/bin/env bash
# Builds the Dockerfile with podman and runs the image's health check and a 2-rank CPU smoke run in it
# (through launch/docker.sh), on a machine that cannot pull the NGC base. The base is made here instead:
# Debian bookworm (debootstrap) + this machine's Python 3.12 + torch. Every pip install in the builds
# reads a wheelhouse downloaded on the host (pip download), so the builds run with --network none.
# Root only; about 9 minutes and 15 GB (wheelhouse, root file system, images) on a fresh machine,
# 1.5 minutes once they are cached. .ci/run runs it after the tests. Prints "skipped: <reason>" and
# exits 0 where podman or debootstrap is missing and apt-get cannot install it, or where podman
# cannot start even a bare Debian container (the host forbids it): those say nothing about the image.
#   scripts/docker_check.sh
# Env: WORK (default /var/tmp/megatron-rlhf-docker-check; the rootfs, wheelhouse and podman config
# stay there and are reused), PYTHON312 (the Python 3.12 to copy into the base; default python3.12).
# The check images keep PIP_NO_INDEX=1 / PIP_FIND_LINKS=/wheels from their base: they are for this
# check, not for use.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${WORK:-/var/tmp/megatron-rlhf-docker-check}"
RAW=localhost/megatron-rlhf-rootfs:bookworm-py312
BASE=localhost/megatron-rlhf-base:bookworm-py312
IMAGE=localhost/megatron-rlhf:check

skip() { echo "skipped: $*"; exit 0; }
stage() { printf '[%4ds] %s\n' "$SECONDS" "$*"; }

[[ "$(id -u)" == 0 ]] || skip "needs root (podman with overlay storage, debootstrap)"
if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null || ! command -v runc >/dev/null; then
  command -v apt-get >/dev/null || skip "podman/debootstrap/runc missing and no apt-get"
  stage "apt-get install podman debootstrap runc"
  # A fresh machine may have no package lists yet: update them once if the install fails.
  apt-get install -y -q podman debootstrap runc >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q podman debootstrap runc >/dev/null; } \
    || skip "apt-get could not install podman debootstrap runc"
fi
PY="$(command -v "${PYTHON312:-python3.12}")" || skip "no python3.12 to copy into the base (set PYTHON312)"
PREFIX="$("$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.base_prefix)')" \
  || skip "$PY is not Python 3.12"
TORCH="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])' 2>/dev/null || echo 2.11.0)"

mkdir -p "$WORK/wheels"
# crun fails to start containers on some hosts (cgroup set-up); runc works. Low ulimits: podman's
# default ones can exceed what this host allows a container. The same for launch/docker.sh's runs,
# whose --ulimit flags replace podman's defaults: memlock=-1 is left out (a root without
# CAP_SYS_RESOURCE cannot raise it). No healthcheck timers: they need systemd.
export CONTAINERS_CONF="$WORK/containers.conf"
export DOCKER=podman GPUS='' IMAGE ULIMITS="nofile=1024:1024 nproc=1024:1024 stack=67108864" \
  DOCKER_RUN_ARGS=--no-healthcheck
cat > "$CONTAINERS_CONF" <<'CONF'
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
[engine]
runtime = "runc"
CONF

stage "wheelhouse: torch==$TORCH, megatron-core, megatron-rlhf[test] and their dependencies"
"$PY" -m pip download -d "$WORK/wheels" "torch==$TORCH" "megatron-core==0.19.2" "${ROOT}[test]" setuptools wheel \
  >"$WORK/download.log" 2>&1 || { tail -30 "$WORK/download.log"; exit 1; }
rm -f "$WORK"/wheels/megatron_rlhf-* "$WORK"/wheels/megatron-rlhf-*  # the build installs it from the source
echo "  $(find "$WORK/wheels" -type f | wc -l) files, $(du -sh "$WORK/wheels" | cut -f1)"

if ! podman image exists "$BASE"; then
  if [[ ! -f "$WORK/rootfs/etc/debian_version" ]]; then
    stage "debootstrap bookworm (minbase + Python's shared libraries, ca-certificates, git)"
    debootstrap --variant=minbase \
      --include=ca-certificates,libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,zlib1g,libreadline8,libncursesw6,libgdbm6,libuuid1,git \
      bookworm "$WORK/rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log"
  fi
  stage "Python 3.12 from $PREFIX (same path: its launcher finds libpython there), without site-packages"
  mkdir -p "$WORK/rootfs$PREFIX"
  tar -C "$PREFIX" --exclude="./lib/python3.12/site-packages/*" -cf - . | tar -C "$WORK/rootfs$PREFIX" -xf -
  stage "podman import -> $RAW"
  tar -C "$WORK/rootfs" -cf - . | podman import -q \
    --change "ENV PATH=$PREFIX/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV PIP_NO_INDEX=1" --change "ENV PIP_FIND_LINKS=/wheels" - "$RAW" >/dev/null
  podman run --rm --network none "$RAW" true >"$WORK/preflight.log" 2>&1 \
    || skip "podman cannot run a bare Debian container on this host: $(tail -1 "$WORK/preflight.log")"
  stage "base $BASE: pip (ensurepip) and torch, as an NGC image has them"
  printf 'FROM %s\nRUN python -m ensurepip --default-pip && pip install --no-cache-dir torch==%s\n' "$RAW" "$TORCH" \
    > "$WORK/Containerfile.base"
  podman build --network none -v "$WORK/wheels:/wheels:ro" -t "$BASE" -f "$WORK/Containerfile.base" "$WORK" \
    >"$WORK/base.log" 2>&1 || { tail -30 "$WORK/base.log"; exit 1; }
fi

stage "launch/docker.sh build (Dockerfile on $BASE, docker format: keeps HEALTHCHECK)"
"$ROOT/launch/docker.sh" build --format docker --network none \
  -v "$WORK/wheels:/wheels:ro" --build-arg BASE_IMAGE="$BASE" >"$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log"; exit 1; }
healthcheck="$(podman image inspect --format '{{index .Config.Healthcheck.Test 1}}' "$IMAGE" 2>/dev/null)"
[[ $healthcheck == *"megatron-rlhf --version"* ]] || { echo "docker_check: the image has no HEALTHCHECK" >&2; exit 1; }
echo "  image $(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.1f GB", $1 / 1e9}')"

stage "the image's HEALTHCHECK command, run once: $healthcheck"
podman run --rm --no-healthcheck "$IMAGE" sh -c "$healthcheck" || { echo "docker_check: HEALTHCHECK failed" >&2; exit 1; }

stage "launch/docker.sh health (versions + CPU smoke run)"
health="$("$ROOT/launch/docker.sh" health 2>&1)" || { echo "$health" | tail -30; exit 1; }
echo "$health" | grep -E "^megatron-rlhf .*torch|smoke run done"
grep -q "megatron-core 0.19.2" <<<"$health" || { echo "docker_check: no megatron-core 0.19.2 in the health output" >&2; exit 1; }

stage "launch/docker.sh run --nproc 2 smoke (torchrun, 2 gloo ranks, the checkout mounted)"
run="$("$ROOT/launch/docker.sh" run --nproc 2 smoke device=cpu actor.tp=2 \
  output_dir=/tmp/smoke 2>&1)" || { echo "$run" | tail -30; exit 1; }
echo "$run" | grep -E "world 2|smoke run done"
grep -q "world 2 on cpu" <<<"$run" || { echo "docker_check: the run was not 2 ranks" >&2; exit 1; }
stage "ok"
