"""``megatron-rlhf pipeline``'s configuration: the stages to run and each stage's section (the stages
are described in ``pipeline.py``), apart from the pipeline so that reading and checking a config
imports no megatron-core."""

from __future__ import annotations

import dataclasses

from megatron_rlhf.agent.config import MultiTurnConfig
from megatron_rlhf.config.fields import at_least
from megatron_rlhf.config.loader import config_errors, raise_if_errors
from megatron_rlhf.config.run import RunConfig
from megatron_rlhf.rollout.native_config import NativeEngineConfig
from megatron_rlhf.rollout.sampling import SamplingParams
from megatron_rlhf.trainer.ppo_config import PPOConfig
from megatron_rlhf.trainer.supervised_config import RMConfig, SFTConfig

STAGES = ("sft", "pairs", "rm", "grpo", "ppo", "test")


@dataclasses.dataclass(kw_only=True)
class PairsConfig:
    """The reward model's data, from the SFT policy's own samples (``pairs`` stage)."""

    policy: str = ""
    """The model sampled (the SFT stage's ``hf/``)."""
    train_prompts: list[str] = dataclasses.field(default_factory=list)
    """Prompt files with an ``answer`` column (``builtin:arithmetic-prompts``)."""
    validation_prompts: list[str] = dataclasses.field(default_factory=list)
    """The same for the reward model's validation pairs."""
    num_train_prompts: int = 1000
    """The first this many train prompts are sampled."""
    num_validation_prompts: int = 300
    """The first this many validation prompts are sampled."""
    pairs_per_prompt: int = 2
    """Distinct (chosen, rejected) pairs taken from each prompt's samples, at most."""
    sampling: SamplingParams = dataclasses.field(default_factory=lambda: SamplingParams(n=8, max_new_tokens=40))
    """How the policy is sampled: ``n`` responses per prompt at ``temperature``."""
    engine: NativeEngineConfig = dataclasses.field(default_factory=NativeEngineConfig)
    output_dir: str = "runs/pipeline/pairs"
    """Where ``train.jsonl``, ``validation.jsonl`` and ``summary.json`` are written."""

    def errors(self) -> list[str]:
        return at_least(self, 1, "num_train_prompts", "num_validation_prompts", "pairs_per_prompt")


@dataclasses.dataclass(kw_only=True)
class TestConfig:
    """Held-out accuracy of the SFT model and of each RL stage's model (``test`` stage)."""

    prompts: list[str] = dataclasses.field(default_factory=lambda: ["builtin:arithmetic-test"])
    """Prompt files with an ``answer`` column, sharing no problem with any train row."""
    max_new_tokens: int = 64
    """A response not finished (EOS) within this many tokens counts as malformed."""
    engine: NativeEngineConfig = dataclasses.field(default_factory=NativeEngineConfig)
    multi_turn: MultiTurnConfig = dataclasses.field(default_factory=MultiTurnConfig)
    """With enable=true, each answer is a multi-turn trajectory with these tools (the tool task
    tests its models as its RL stage trains them), judged on its whole text."""
    output_dir: str = "runs/pipeline/test"
    """Where each model's greedy responses and verdicts are written (``<model>.jsonl``)."""

    def errors(self) -> list[str]:
        return at_least(self, 1, "max_new_tokens")


@dataclasses.dataclass(kw_only=True)
class PipelineConfig(RunConfig):
    """``megatron-rlhf pipeline``: the stages to run and each stage's config (module docstring).
    The top-level run fields (device, dtype, seed, output_dir) reach the stages through the
    preset's interpolations."""

    stages: list[str] = dataclasses.field(default_factory=lambda: list(STAGES))
    """Stages to run, in this order (a subset of sft, pairs, rm, grpo, ppo, test)."""
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    pairs: PairsConfig = dataclasses.field(default_factory=PairsConfig)
    rm: RMConfig = dataclasses.field(default_factory=RMConfig)
    grpo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    test: TestConfig = dataclasses.field(default_factory=TestConfig)

    def errors(self) -> list[str]:
        unknown = [stage for stage in self.stages if stage not in STAGES]
        if unknown:
            return [f"stages={self.stages}: unknown {unknown}; expected some of {list(STAGES)}"]
        order = [s for s in STAGES if s in self.stages]
        return [] if self.stages == order else [f"stages={self.stages}: expected pipeline order, each once: {order}"]


def check_pipeline_config(cfg: PipelineConfig) -> None:
    """The checks of the stages' sections that need no model (module docstring), all at once."""
    raise_if_errors(config_errors(cfg, unused=[s for s in STAGES if s not in cfg.stages]))
