"""device=auto on a machine whose GPU torch cannot use (a driver older than torch's CUDA): the run
still goes to the CPU, as the README's main job promises, and says why once."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rlhf.parallel import distributed


@pytest.mark.parametrize("visible", [None, "0", ""])
def test_a_gpu_torch_cannot_use_is_named_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], visible: str | None
) -> None:
    gpu = tmp_path / "nvidia0"
    gpu.touch()
    monkeypatch.setattr(distributed, "NVIDIA_DEVICE", gpu)
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: False)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    distributed._warn_unusable_gpu.cache_clear()
    assert distributed.resolve_device("auto") == distributed.resolve_device("auto") == "cpu"
    warned = capsys.readouterr().err.count(f"this machine has an NVIDIA GPU ({gpu}) that torch")
    assert warned == (0 if visible == "" else 1)  # CUDA_VISIBLE_DEVICES="" hides it on purpose
    gpu.unlink()
    distributed._warn_unusable_gpu.cache_clear()
    assert distributed.resolve_device("auto") == "cpu" and "NVIDIA" not in capsys.readouterr().err
