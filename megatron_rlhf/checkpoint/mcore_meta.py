"""The ``megatron_rlhf.json`` file that marks a megatron-rlhf model checkpoint (``mcore.py``) and
records the HF config it was built from; the ``train_state.json`` that marks a run checkpoint's
trained model (``train_state.py``).

Apart from ``mcore.py`` so that a config's checks read a checkpoint's architecture without
importing megatron-core.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rlhf.models.architecture import Architecture, architecture_from_hf_config

FORMAT_VERSION = 1
META_FILE = "megatron_rlhf.json"
TRAINED_STATE_FILE = "train_state.json"
"""Beside a run checkpoint's trained model (``CHECKPOINT/models/NAME``) and its optimizer's state."""


def is_mcore_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def is_trained_model(path: str | Path) -> bool:
    """Whether ``path`` is a run checkpoint's trained model (``.../checkpoints/step_N/models/NAME``)."""
    return (Path(path) / TRAINED_STATE_FILE).is_file()


def read_architecture(ckpt_dir: str | Path) -> Architecture:
    meta_path = Path(ckpt_dir) / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{ckpt_dir}: no {META_FILE} here, so not a megatron-rlhf model checkpoint (what `convert "
            "hf-to-mcore` writes), nor a run checkpoint's model (CHECKPOINT/models/NAME, e.g. "
            "runs/x/checkpoints/step_10/models/actor); an HF model directory needs no conversion to be read"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta_path}: not valid JSON ({err})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: format_version={meta.get('format_version')} is not supported "
            f"(this build reads {FORMAT_VERSION})"
        )
    return architecture_from_hf_config(meta["hf_config"], source=f"{meta_path}:hf_config")
