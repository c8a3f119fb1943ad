# megatron-rlhf on an NVIDIA PyTorch (NGC) image, which ships torch, apex and transformer-engine.
# The project needs Python >= 3.12: NGC PyTorch 25.01 and later have it (24.xx images are 3.10).
#   docker build -t megatron-rlhf:latest .        (or: launch/docker.sh build)
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/megatron-rlhf

# Package metadata and source first, so the dependency layer is rebuilt only when they change.
COPY setup.py README.md ./
COPY megatron_rlhf/ megatron_rlhf/

# Keep the image's own torch / transformer-engine / apex builds: pip must never swap them for
# PyPI wheels. This constraints file replaces the image's PIP_CONSTRAINT on purpose: it pins
# only that compiled stack, so the project's other dependencies may move.
RUN pip list --format=freeze | grep -E '^(torch|transformer.engine|apex)' > /tmp/constraints.txt \
 && cat /tmp/constraints.txt \
 && pip install --no-cache-dir --no-deps megatron-core==0.19.2 \
 && PIP_CONSTRAINT=/tmp/constraints.txt pip install --no-cache-dir -e ".[test]"

# The rest (scripts, launch, tests, configs); see .dockerignore for what stays out.
COPY . .

# NVLink multicast off (NCCL NVLS and torch symmetric-memory multicast).
ENV NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

CMD ["launch/torchrun.sh", "ppo"]
