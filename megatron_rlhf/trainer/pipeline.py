"""``megatron-rlhf pipeline``: a model made from scratch here, then improved by RL, one stage after
the other in one process (or one torchrun job):

    sft     imitate the task's demonstrations (``megatron-rlhf sft``)
    pairs   sample the SFT policy, judge each sample by the task's answer check, and pair a right
            response (chosen) with a wrong or malformed one (rejected) of the same prompt
    rm      train a reward model on those pairs, starting from the SFT weights (``megatron-rlhf rm``)
    grpo    GRPO with the rule reward: no critic, no reward model (``megatron-rlhf ppo``)
    ppo     PPO with a critic (GAE, started from the SFT weights), the reward model and the rule
            mixed, and a KL penalty (``megatron-rlhf ppo``)
    test    greedy exact-match accuracy on held-out problems of the SFT model and of each RL
            stage's final model: the pipeline's result

Each stage's section is that command's whole config; the presets chain them by interpolation
(``grpo.actor.path: ${sft.output_dir}/hf``), so every setting is one dotlist key away
(``grpo.actor_optim.lr=1e-4``, ``stages=[grpo,test]``). The sections' own checks run up front;
the checks that read a model (layouts against its heads and layers) run when the stage starts,
as its model may be one an earlier stage writes. A stage is a normal run in its own output_dir:
re-running the pipeline resumes each stage from its checkpoints (a finished stage is not redone).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_rlhf.agent.config import MultiTurnConfig
from megatron_rlhf.checkpoint.run_checkpoint import file_sha256, files_under
from megatron_rlhf.checkpoint.sources import architecture_of
from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.data import Tokenizer, load_prompt_dataset
from megatron_rlhf.data.builtin import resolve_data_paths
from megatron_rlhf.data.chat_template import load_tool_schemas
from megatron_rlhf.data.records import write_jsonl
from megatron_rlhf.metrics.log import is_rank0, log
from megatron_rlhf.parallel.distributed import DistEnv, seed_everything
from megatron_rlhf.rollout.native import NativeEngine
from megatron_rlhf.rollout.native_config import NativeEngineConfig
from megatron_rlhf.rollout.sampling import SamplingParams
from megatron_rlhf.tasks.arithmetic import Verdict, judge, preference_pairs, verdict_rates
from megatron_rlhf.trainer.generate import generate_trajectories, policy_engine, prompt_tools_file
from megatron_rlhf.trainer.pipeline_config import PairsConfig, PipelineConfig, check_pipeline_config
from megatron_rlhf.trainer.ppo import run_ppo
from megatron_rlhf.trainer.rm import run_rm
from megatron_rlhf.trainer.sft import run_sft
from megatron_rlhf.trainer.stop import RunStopped, stop_signals


def run_pipeline(cfg: PipelineConfig, env: DistEnv) -> dict[str, Any]:
    """Run ``cfg.stages`` in order; returns (and writes to ``output_dir/pipeline.json``) each
    stage's time and summary and the held-out accuracies."""
    check_pipeline_config(cfg)
    stages: dict[str, Callable[[], dict[str, Any]]] = {
        "sft": lambda: run_sft(cfg.sft, env),
        "pairs": lambda: make_pairs(cfg.pairs, cfg.sft.dtype, cfg.seed, env),
        "rm": lambda: run_rm(cfg.rm, env),
        "grpo": lambda: run_ppo(cfg.grpo, env),
        "ppo": lambda: run_ppo(cfg.ppo, env),
        "test": lambda: held_out_accuracy(cfg, env),
    }
    result: dict[str, Any] = {"stages": {}}
    with stop_signals() as signals:
        for stage in cfg.stages:
            log(f"pipeline: stage {stage}")
            start = time.perf_counter()
            summary = stages[stage]()
            result["stages"][stage] = {"seconds": time.perf_counter() - start, "summary": summary}
            # A stop asked for during a stage without steps (pairs, test) is honoured after it.
            if stage != cfg.stages[-1] and (code := signals.agreed()) is not None:
                raise RunStopped(
                    f"stopped on request after the pipeline's {stage} stage; the same command goes on from there "
                    "(a finished stage's run says it is complete)",
                    code,
                )
    if "test" in result["stages"]:
        result["test_accuracy"] = result["stages"]["test"]["summary"]
    if is_rank0():
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pipeline.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        log("pipeline done:\n" + _stage_table(result))
    return result


def _stage_table(result: dict[str, Any]) -> str:
    lines = [f"  {'stage':<6} {'seconds':>8}  result"]
    for stage, entry in result["stages"].items():
        summary = entry["summary"]
        if stage == "test":
            shown = ", ".join(f"{model} {acc:.1%}" for model, acc in summary.items())
        elif stage == "pairs":
            shown = f"{summary['train_pairs']} train / {summary['validation_pairs']} validation pairs"
        else:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in (summary.get("validation") or {}).items())
        lines.append(f"  {stage:<6} {entry['seconds']:>8.1f}  {shown}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- sampling and judging


def sample_and_judge(
    engine: NativeEngine,
    tokenizer: Tokenizer,
    prompt_paths: list[str],
    count: int,
    params: SamplingParams,
    multi_turn: MultiTurnConfig | None = None,
) -> tuple[list[str], list[list[str]], list[list[Verdict]]]:
    """Sample ``params.n`` responses to each of the first ``count`` prompts (all of them if fewer)
    and judge each against the prompt's ``answer``: (prompt texts, responses per prompt, verdicts
    per prompt), identical on every rank; with ``multi_turn`` enabled each response is a trajectory
    with its tools, judged (and returned) as its whole text. Collective."""
    tools_file = prompt_tools_file("", multi_turn)
    dataset, _ = load_prompt_dataset(
        resolve_data_paths(prompt_paths),
        tokenizer,
        max_length=engine.cfg.max_seq_len,
        extra_keys=("prompt", "answer"),
        tools=load_tool_schemas(tools_file) if tools_file else None,
        keep_raw_prompt=multi_turn is not None and multi_turn.interactions_read_prompts,
    )
    examples = dataset[: min(count, len(dataset))]
    completions = generate_trajectories(engine, tokenizer, examples, params, multi_turn)
    responses: list[list[str]] = [[] for _ in examples]
    verdicts: list[list[Verdict]] = [[] for _ in examples]
    stop_ids = params.stop_set(engine.cfg.eos_token_ids)
    texts = tokenizer.decode_batch([c.text_ids(stop_ids) for c in completions], skip_special_tokens=True)
    for c, text in zip(completions, texts, strict=True):
        responses[c.prompt_index].append(text)
        verdicts[c.prompt_index].append(
            judge(text, examples[c.prompt_index].extras["answer"], finished=c.finish_reason == "stop")
        )
    return [e.extras["prompt"] for e in examples], responses, verdicts


def _policy(model: str, engine_cfg: NativeEngineConfig, dtype: str, env: DistEnv) -> tuple[NativeEngine, Tokenizer]:
    """A stage's model to sample: all ranks' data parallel (TP 1: the task's models are small)."""
    return policy_engine(model, architecture_of(model), tp=1, dtype=dtype, engine_cfg=engine_cfg, env=env)


def _file_digests(paths: list[Path]) -> dict[str, str]:
    """sha256 of each file of ``paths`` (a folder: of each file under it)."""
    files = [file for p in paths for file in ([p] if p.is_file() else [p / rel for rel in files_under(p)])]
    return {str(file): file_sha256(file) for file in files}


def pairs_inputs(cfg: PairsConfig, dtype: str, seed: int, prompt_files: list[str]) -> dict[str, Any]:
    """What the pairs are made from: the stage's settings (its output_dir aside), the dtype and seed,
    and the digests of the policy's files and of ``prompt_files`` (the prompt settings resolved).
    Equal inputs make equal pairs."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "output_dir"}
    policy = [Path(cfg.policy)] if Path(cfg.policy).exists() else []  # else a built-in name, in settings
    files = _file_digests(policy + [Path(p) for p in prompt_files])
    inputs = {"settings": settings, "dtype": dtype, "seed": seed, "files": files}
    return json.loads(json.dumps(inputs, default=str))  # as it reads back from summary.json


def written_pairs(out: Path, inputs: dict[str, Any]) -> dict[str, Any] | None:
    """The summary of pairs already written to ``out`` from ``inputs``, or None. summary.json is
    written after both pair files, so a stage stopped midway is made again."""
    try:
        written = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if written.pop("made_from", None) != inputs or not all((out / f"{s}.jsonl").is_file() for s in _SPLITS):
        return None
    return written


_SPLITS = ("train", "validation")


def make_pairs(cfg: PairsConfig, dtype: str, seed: int, env: DistEnv) -> dict[str, Any]:
    """The ``pairs`` stage: write the reward model's train and validation pairs; returns counts
    and the sampled policy's verdict rates. Pairs written before from the same inputs are kept: a
    re-run pipeline resumes its rm stage on the data it started with (on a GPU, sampling again
    need not give the same pairs)."""
    out = Path(cfg.output_dir)
    prompt_files = resolve_data_paths([*cfg.train_prompts, *cfg.validation_prompts])  # collective
    inputs = pairs_inputs(cfg, dtype, seed, prompt_files) if is_rank0() else None
    box = [written_pairs(out, inputs) if inputs is not None else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        log(f"pairs: {out} holds the pairs of this policy, prompts and settings: kept (remove it to sample again)")
        return box[0]
    if is_rank0():  # the old summary would vouch for the files being rewritten
        (out / "summary.json").unlink(missing_ok=True)
    seed_everything(seed)
    summary: dict[str, Any] = {}
    engine, tokenizer = _policy(cfg.policy, cfg.engine, dtype, env)
    for split, paths, count in zip(
        _SPLITS,
        (cfg.train_prompts, cfg.validation_prompts),
        (cfg.num_train_prompts, cfg.num_validation_prompts),
        strict=True,
    ):
        prompts, responses, verdicts = sample_and_judge(engine, tokenizer, paths, count, cfg.sampling)
        rows = preference_pairs(prompts, responses, verdicts, seed=seed, pairs_per_prompt=cfg.pairs_per_prompt)
        if not rows:
            raise ValueError(
                f"pairs: no {split} prompt of {paths} got both a right and a wrong sample from "
                f"{cfg.policy} ({verdict_rates(verdicts)}); sample more (pairs.sampling.n)"
            )
        if is_rank0():
            write_jsonl(rows, out / f"{split}.jsonl")
        summary[f"{split}_pairs"] = len(rows)
        summary[f"{split}_policy"] = verdict_rates(verdicts)
    if is_rank0():
        (out / "summary.json").write_text(json.dumps({**summary, "made_from": inputs}, indent=2) + "\n")
    dist.barrier()
    log(
        f"pairs: {summary['train_pairs']} train and {summary['validation_pairs']} validation pairs -> {out}; "
        f"the policy's samples were right {summary['train_policy']['right']:.1%} of the time"
    )
    return summary


def held_out_accuracy(cfg: PipelineConfig, env: DistEnv) -> dict[str, float]:
    """The ``test`` stage: greedy exact-match accuracy on ``test.prompts`` of the SFT model and of
    every RL stage's exported model that exists."""
    models = {
        "sft": Path(cfg.sft.output_dir) / "hf",
        "grpo": Path(cfg.grpo.output_dir) / "hf",
        "ppo": Path(cfg.ppo.output_dir) / "hf",
    }
    found = {name: path for name, path in models.items() if (path / "config.json").is_file()}
    if not found:
        raise ConfigError(f"test: none of {[str(p) for p in models.values()]} holds a model; run the sft stage first")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=cfg.test.max_new_tokens)
    accuracy = {}
    for name, path in found.items():
        engine, tokenizer = _policy(str(path), cfg.test.engine, cfg.dtype, env)
        prompts, responses, verdicts = sample_and_judge(
            engine, tokenizer, cfg.test.prompts, 1 << 30, greedy, cfg.test.multi_turn
        )
        accuracy[name] = verdict_rates(verdicts)["right"]
        if is_rank0():
            write_jsonl(
                [
                    {"prompt": p, "response": r[0], "verdict": v[0]}
                    for p, r, v in zip(prompts, responses, verdicts, strict=True)
                ],
                Path(cfg.test.output_dir) / f"{name}.jsonl",
            )
        log(f"test: {name} ({path}) greedy accuracy {accuracy[name]:.1%} on {len(verdicts)} held-out problems")
    return accuracy
