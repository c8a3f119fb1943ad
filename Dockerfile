# megatron-rlhf on an NVIDIA PyTorch (NGC) image, which ships torch, apex and transformer-engine.
# The project needs Python >= 3.12 and torch >= 2.11 (setup.py): NGC PyTorch 26.05 ships torch 2.12.0a0,
# CUDA 13.2 and Python 3.12 (25.xx images have torch 2.10 or older, which pip refuses).
#   docker build -t megatron-rlhf:latest .        (or: launch/docker.sh build)
# BASE_IMAGE needs python/pip (>= 3.12) on PATH and torch installed; scripts/docker_check.sh builds on
# a local Debian base (torch CPU) where NGC cannot be pulled.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.05-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/megatron-rlhf

# Package metadata and source first, so the dependency layer is rebuilt only when they change.
COPY setup.py README.md ./
COPY megatron_rlhf/ megatron_rlhf/

# Keep the image's own torch / transformer-engine / apex builds: pip must never swap them for
# PyPI wheels. This constraints file replaces the image's PIP_CONSTRAINT on purpose: it pins
# only that compiled stack, so the project's other dependencies may move. pipefail: a failed
# `pip list` must fail the build, not leave an empty constraints file. The test extra is installed
# because the image is where a cluster node runs the GPU test tier (with apex and transformer-engine).
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN pip list --format=freeze | grep -E '^(torch|transformer.engine|apex)' > /tmp/constraints.txt \
 && cat /tmp/constraints.txt \
 && pip install --no-cache-dir --no-deps megatron-core==0.19.2 \
 && PIP_CONSTRAINT=/tmp/constraints.txt pip install --no-cache-dir -e ".[test]"

# The rest (scripts, launch, tests, configs); see .dockerignore for what stays out.
COPY . .

# NVLink multicast off (NCCL NVLS and torch symmetric-memory multicast).
ENV NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

# Health: the versions line every run logs, after importing megatron-core (a second or two; it fails
# where the install cannot run). Cheap on purpose: it runs every 30 minutes beside training. The fuller
# check, the four built-in tiny models built and run on CPU (about 20 s), is `launch/docker.sh health`.
# Kept in the image only by the docker image format (`podman build --format docker`); OCI images drop it.
# Shell form on purpose: `|| exit 1` maps any failure to the one status docker reads as unhealthy.
# hadolint ignore=DL3025
HEALTHCHECK --interval=30m --timeout=2m --retries=1 CMD megatron-rlhf --version || exit 1

CMD ["launch/torchrun.sh", "ppo", "--config", "ppo-tiny"]
