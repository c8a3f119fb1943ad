"""torchrun worker (1 GPU): train -> generate -> train round trip of the hybrid engine.

Train one step, release the training memory (grad buffers freed, optimizer state to pinned CPU),
generate with the native engine reading the training weights in place (zero copy), bring the
training memory back: parameters, main parameters, Adam moments and RNG states must be bit-identical
to before the detour, and the next step must run. Figures go to OUT/results.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launch import WorkerSession, worker_session


def snapshot(state) -> dict[str, torch.Tensor]:
    tensors = {f"model.{n}": p.detach().cpu().clone() for n, p in state.role.model.named_parameters()}
    for i, inner in enumerate(state.optimizer.chained_optimizers):
        for j, group in enumerate(inner.optimizer.param_groups):
            for k, param in enumerate(group["params"]):
                tensors[f"main.{i}.{j}.{k}"] = param.detach().cpu().clone()
                for key, value in inner.optimizer.state[param].items():
                    if torch.is_tensor(value):
                        tensors[f"state.{i}.{j}.{k}.{key}"] = value.detach().cpu().clone()
    tensors["rng.cpu"] = torch.get_rng_state()
    tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return tensors


def main(session: WorkerSession) -> None:
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.hybrid.memory import TrainingMemory
    from megatron_rlhf.rollout.native import NativeEngine
    from megatron_rlhf.rollout.native_config import NativeEngineConfig
    from megatron_rlhf.rollout.sampling import SamplingParams
    from megatron_rlhf.training.objectives import sft_loss
    from megatron_rlhf.training.optim import OptimConfig, make_train_state
    from megatron_rlhf.training.train import train_step

    env = session.env
    role = build_role(
        "actor",
        ModelConfig(path="builtin:tiny-llama"),
        architecture_of("builtin:tiny-llama"),
        world_size=1,
        dtype=torch.bfloat16,
        device=env.device,
    )
    state = make_train_state(role, OptimConfig(lr=1e-3))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (8, 64), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    train_step(state, batch, sft_loss(role), max_tokens_per_micro_batch=256)
    before = snapshot(state)
    memory = TrainingMemory(state)
    allocated_train = torch.cuda.memory_allocated()
    start = time.perf_counter()
    moved = memory.to_generation()
    release_s = time.perf_counter() - start
    allocated_generate = torch.cuda.memory_allocated()
    engine = NativeEngine(role, NativeEngineConfig(max_batch_size=8, max_seq_len=96))
    completions = engine.generate(
        [ids[i, :16].tolist() for i in range(8)], SamplingParams(temperature=1.0, max_new_tokens=32, seed=5)
    )
    del engine
    start = time.perf_counter()
    memory.to_training()
    restore_s = time.perf_counter() - start
    after = snapshot(state)
    different = [k for k in before if not torch.equal(before[k], after[k])]
    metrics = train_step(state, batch, sft_loss(role), max_tokens_per_micro_batch=256)
    session.results.update(
        {
            "tensors_compared": len(before),
            "tensors_different": len(different),
            "allocated_training_GiB": allocated_train / 1024**3,
            "allocated_generation_GiB": allocated_generate / 1024**3,
            "release_s": release_s,
            "restore_s": restore_s,
            "bytes_moved": moved,
            "generated_tokens": sum(len(c.token_ids) for c in completions),
            "next_step_loss": metrics["loss"],
        }
    )
    assert not different, f"round trip changed {different[:5]}"
    assert moved > 0 and allocated_generate < allocated_train
    assert torch.isfinite(torch.tensor(metrics["loss"]))


if __name__ == "__main__":
    with worker_session("cuda") as session:
        main(session)
