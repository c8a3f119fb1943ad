"""``megatron-rlhf convert``: HF safetensors <-> megatron-rlhf checkpoints (``checkpoint/convert.py``)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal

from megatron_rlhf.commands.config_args import add_config_args, print_config, unset_errors
from megatron_rlhf.config.fields import at_least
from megatron_rlhf.config.flags import add_flag_aliases
from megatron_rlhf.config.loader import config_errors, load_config_with_sources, raise_if_errors
from megatron_rlhf.parallel.distributed import Device

HELP = "convert checkpoints between HF safetensors and megatron format"
DESCRIPTION = (
    "hf-to-mcore: read an HF model directory straight into a TP/PP layout and save it as a megatron-rlhf "
    "checkpoint (dist_checkpointing); under torchrun the world size must be a multiple of tp*pp. mcore-to-hf: "
    "load a megatron-rlhf checkpoint (saved in any layout) and write an HF model directory (safetensors + "
    "config.json) that transformers' from_pretrained can load; a run checkpoint's model "
    "(.../checkpoints/step_N/models/NAME) is written as the run's export writes it, a LoRA model merged, with its "
    "PEFT adapter in OUTPUT_adapter. The first three words are direction, source and "
    "output: megatron-rlhf convert hf-to-mcore HF_DIR OUT_DIR tp=2 pp=2 is "
    "megatron-rlhf convert direction=hf-to-mcore source=HF_DIR output=OUT_DIR tp=2 pp=2."
)


@dataclasses.dataclass(kw_only=True)
class ConvertConfig:
    direction: Literal["hf-to-mcore", "mcore-to-hf"] | None = None
    """Required: hf-to-mcore (an HF model directory to a megatron-rlhf checkpoint) or mcore-to-hf."""
    source: str = ""
    """Required: the HF model directory (hf-to-mcore) or the megatron-rlhf checkpoint (mcore-to-hf)."""
    output: str = ""
    """Required: the directory written."""
    tp: int = 1
    """Tensor-parallel size of the layout the weights are read or written in."""
    pp: int = 1
    """Pipeline-parallel size of the layout the weights are read or written in."""
    device: Device = "auto"
    """auto (cuda when a GPU is visible, else cpu), cuda, or cpu."""

    def errors(self) -> list[str]:
        return unset_errors(self, "direction", "source", "output") + at_least(self, 1, "tp", "pp")


def schema() -> type:
    return ConvertConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, default=None, example="hf-to-mcore /models/Qwen2.5-7B ckpt/qwen tp=2 pp=2", prefix=())
    add_flag_aliases(parser.add_argument_group("flags (each sets the key it names)"), "convert", ConvertConfig)


def run(args: argparse.Namespace) -> int:
    cfg, sources = load_config_with_sources(args.config, args.overrides, schema=ConvertConfig)
    raise_if_errors(config_errors(cfg))
    if args.print_config:
        print_config(cfg, sources)
        return 0
    from megatron_rlhf.checkpoint.convert import convert

    assert cfg.direction is not None, "errors() refuses a config without a direction"
    convert(cfg.direction, cfg.source, cfg.output, tp=cfg.tp, pp=cfg.pp, device=cfg.device)
    return 0
