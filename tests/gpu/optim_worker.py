"""torchrun worker (1 GPU, bf16): the actor's optimizer on torch's fused Adam (``fuse_device_adam``).

Three optimizer steps on given gradients, checked against torch's single-tensor AdamW in float64
over the same fp32 main parameters and gradients (weight decay per megatron's parameter groups);
then a checkpoint after step 2, loaded into a fresh state, whose step 3 must equal the uninterrupted
one's. Last, the warm-up's reads of the gradients (``warm_up_gradient_reads``) on an fp16 state,
whose dynamic loss scaler counts each ``prepare_grads`` as a step without overflow: it must be left
as it was. Figures go to OUT/results.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launch import WorkerSession, worker_session


def main(session: WorkerSession) -> None:
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.checkpoint.train_state import load_train_state, save_train_state
    from megatron_rlhf.training.optim import OptimConfig, make_train_state, torch_optimizers
    from megatron_rlhf.training.train import warm_up_gradient_reads

    env, out, results = session.env, session.out, session.results
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0)

    def fresh_state(dtype: torch.dtype = torch.bfloat16):
        role = build_role(
            "actor",
            ModelConfig(path="builtin:tiny-llama"),
            architecture_of("builtin:tiny-llama"),
            world_size=1,
            dtype=dtype,
            device=env.device,
        )
        return make_train_state(role, cfg)

    def main_params(state) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter, float]]:
        """(model parameter, its fp32 main parameter, weight decay) of every parameter."""
        (inner,) = state.optimizer.chained_optimizers
        found = []
        for model_param, (group, order) in inner.model_param_group_index_map.items():
            group_settings = inner.optimizer.param_groups[group]
            found.append((model_param, group_settings["params"][order], group_settings["weight_decay"]))
        return found

    def fill_grads(state, number: int) -> None:
        state.ddp_model.zero_grad_buffer()
        for index, (model_param, _, _) in enumerate(main_params(state)):
            g = torch.Generator(device=env.device).manual_seed(1000 * number + index)
            model_param.main_grad.copy_(torch.randn(model_param.shape, generator=g, device=env.device))

    def step(state, number: int) -> None:
        fill_grads(state, number)
        ok, _, _ = state.optimizer.step()
        assert ok
        state.scheduler.step(increment=1)
        state.step += 1

    state = fresh_state()
    (torch_optimizer,) = torch_optimizers(state.optimizer)
    results["fused"] = [bool(g["fused"]) and not g["foreach"] for g in torch_optimizer.param_groups]
    params = main_params(state)
    reference = [p.detach().double().clone().requires_grad_() for _, p, _ in params]
    ref_optimizer = torch.optim.AdamW(
        [{"params": [r], "weight_decay": wd} for r, (_, _, wd) in zip(reference, params, strict=True)],
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        foreach=False,
        fused=False,
    )
    for number in (1, 2, 3):
        if number == 3:
            save_train_state(state, out / "ckpt")
        step(state, number)
        for r, (model_param, _, _) in zip(reference, params, strict=True):
            r.grad = model_param.main_grad.detach().view(r.shape).double().clone()
        ref_optimizer.step()
    results["max_error_vs_float64"] = max(
        (p.detach().double() - r).abs().max().item() for r, (_, p, _) in zip(reference, params, strict=True)
    )
    steps = [torch_optimizer.state[p]["step"] for _, p, _ in params]
    results["steps"] = sorted({s.item() for s in steps})
    results["steps_on_device"] = all(s.is_cuda for s in steps)
    results["steps_unshared"] = len({id(s) for s in steps}) == len(steps)
    after_three = [p.detach().clone() for _, p, _ in params]

    resumed = fresh_state()
    load_train_state(resumed, out / "ckpt")
    (resumed_optimizer,) = torch_optimizers(resumed.optimizer)
    results["fused_after_load"] = [bool(g["fused"]) for g in resumed_optimizer.param_groups]
    step(resumed, 3)
    resumed_params = [p for _, p, _ in main_params(resumed)]
    results["resumed_equal"] = all(torch.equal(a, p) for a, p in zip(after_three, resumed_params, strict=True))
    resumed_steps = [resumed_optimizer.state[p]["step"] for _, p, _ in main_params(resumed)]
    results["resumed_steps"] = sorted({s.item() for s in resumed_steps})
    results["resumed_steps_on_device"] = all(s.is_cuda for s in resumed_steps)

    half = fresh_state(torch.float16)
    (scaler,) = [inner.grad_scaler for inner in half.optimizer.chained_optimizers]

    def scaler_state() -> list[float]:
        return [scaler.scale.item(), scaler._growth_tracker, scaler._hysteresis_tracker]

    before = scaler_state()
    fill_grads(half, 1)
    warm_up_gradient_reads(half)
    results["fp16_scaler"] = [before, scaler_state()]
    half.optimizer.prepare_grads()  # unrestored: the scaler counts a step without overflow
    results["fp16_scaler_after_prepare_grads"] = scaler_state()


if __name__ == "__main__":
    with worker_session("cuda") as session:
        main(session)
