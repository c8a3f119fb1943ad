"""``megatron-rlhf generate``: completions for a file of prompts (``trainer/generate.py``)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from megatron_rlhf.agent.config import MultiTurnConfig
from megatron_rlhf.commands.config_args import add_config_args, print_config, unset_errors
from megatron_rlhf.config.flags import add_flag_aliases
from megatron_rlhf.config.loader import config_errors, load_config_with_sources, raise_if_errors
from megatron_rlhf.config.run import DeviceConfig
from megatron_rlhf.data.builtin import data_path_errors
from megatron_rlhf.data.config import PromptRowsConfig
from megatron_rlhf.rollout.native_config import NativeEngineConfig
from megatron_rlhf.rollout.sampling import SamplingParams

HELP = "sample completions for a file of prompts with the native engine"
OUTPUT_FORMATS = (".jsonl", ".parquet")
"""The suffixes ``output`` may have: each picks its format (``trainer/generate.write_rows``)."""
DESCRIPTION = (
    "Read prompts (.jsonl/.parquet rows with 'prompt' text or 'prompt_ids'), generate with the "
    "native engine (KV cache, continuous batching) and write rows (.jsonl or .parquet) with token_ids, text, per-token "
    "logprobs and finish_reason. Under torchrun the world is split into groups of rollout.tp ranks. The "
    "settings ppo also has are ppo's keys (rollout.sampling.*, rollout.engine.*, rollout.multi_turn.*, rollout.tp, "
    "device, dtype). "
    "Example: megatron-rlhf generate model=builtin:tiny-llama input=builtin:arithmetic-test output=out.jsonl "
    "rollout.sampling.n=4"
)


@dataclasses.dataclass(kw_only=True)
class GenerateRolloutConfig:
    """Generation's layout, sampling and engine: the keys of ppo's ``rollout`` section that apply here."""

    tp: int = 1
    """Tensor-parallel size of generation; the rest of the world is data-parallel."""
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    """How completions are sampled (n per prompt, temperature, top-k/top-p, max_new_tokens, stops)."""
    engine: NativeEngineConfig = dataclasses.field(default_factory=NativeEngineConfig)
    """The native engine: KV-cache slots, CUDA graphs."""
    multi_turn: MultiTurnConfig = dataclasses.field(default_factory=MultiTurnConfig)
    """Multi-turn responses with tools (tool_config_path), each a trajectory as in ppo's rollouts."""

    def errors(self) -> list[str]:
        return [] if self.tp >= 1 else [f"tp={self.tp} must be >= 1"]


@dataclasses.dataclass(kw_only=True)
class GenerateConfig(DeviceConfig):
    model: str = ""
    """Required: the policy, an HF model directory, a megatron-rlhf checkpoint or builtin:NAME."""
    input: str = ""
    """Required: the prompts, a .jsonl or .parquet file or a built-in set such as builtin:arithmetic-test."""
    output: str = ""
    """Required: the file the completions are written to: .jsonl, or .parquet (the same columns)."""
    data: PromptRowsConfig = dataclasses.field(default_factory=PromptRowsConfig)
    """How the input's rows are read and rendered (ppo's data.* keys that apply here): render prompts
    as the run being sampled was trained on them (e.g. data.chat_template_kwargs={enable_thinking: false})."""
    rollout: GenerateRolloutConfig = dataclasses.field(default_factory=GenerateRolloutConfig)
    """Generation's layout, sampling and engine (ppo's rollout.* keys)."""

    def errors(self) -> list[str]:
        errors = unset_errors(self, "model", "input", "output") + self._output_errors()
        errors += data_path_errors("input", [self.input]) if self.input else []
        errors += self.rollout.multi_turn.offered_tools_errors(self.data.tools_file)
        sampling = self.rollout.sampling
        if sampling.temperature == 0 and sampling.n > 1:
            errors.append(
                f"rollout.sampling.n={sampling.n} at temperature 0 (greedy) makes {sampling.n} identical completions "
                "of each prompt: sample with a temperature > 0, or n=1"
            )
        return errors

    def _output_errors(self) -> list[str]:
        """Checked before the model loads: the output is written only once every completion is made."""
        if not self.output:
            return []
        output = Path(self.output)
        if self.input and output.resolve() == Path(self.input).resolve():
            return [f"output={self.output} is the input: the completions would replace the prompts"]
        if output.is_dir():
            return [f"output={self.output} is a directory; give the .jsonl or .parquet file to write"]
        if output.suffix not in OUTPUT_FORMATS:
            return [f"output={self.output}: expected a .jsonl or .parquet file name (the suffix picks the format)"]
        return []


def schema() -> type:
    return GenerateConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(
        parser, default=None, example="model=DIR input=prompts.jsonl output=out.jsonl rollout.tp=2", prefix=()
    )
    add_flag_aliases(parser.add_argument_group("flags (each sets the key it names)"), "generate", GenerateConfig)


def run(args: argparse.Namespace) -> int:
    cfg, sources = load_config_with_sources(args.config, args.overrides, schema=GenerateConfig)
    raise_if_errors(config_errors(cfg))
    if args.print_config:
        print_config(cfg, sources)
        return 0
    if os.environ.get("RANK", "0") == "0":
        print(sources.report(), flush=True)
    from megatron_rlhf.trainer.generate import run_generate

    run_generate(
        model=cfg.model,
        input_path=cfg.input,
        output_path=cfg.output,
        data=cfg.data,
        tp=cfg.rollout.tp,
        device=cfg.device,
        dtype=cfg.dtype,
        params=cfg.rollout.sampling,
        engine_cfg=cfg.rollout.engine,
        multi_turn=cfg.rollout.multi_turn,
    )
    return 0
