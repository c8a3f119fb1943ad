"""Generation outside a training run: prompts (JSONL/Parquet) in, completions (JSONL/Parquet) out, the work
of ``megatron-rlhf generate``; and ``policy_engine``, a causal LM with its own native engine, which
the pipeline's held-out test uses too.

Input rows hold ``prompt`` (text, tokenized with the model's tokenizer, or a list of chat messages,
rendered with its chat template) or ``prompt_ids``. Under torchrun the world is split into
generation groups of ``rollout.tp`` ranks; each data-parallel group takes every dp-th prompt, and rank 0
writes all completions in prompt order. Output rows:
``prompt_index`` (the prompt's row in the input, 0-based, rows skipped under ``data.on_invalid=skip``
counted), ``prompt`` (the prompt as the model read it, special tokens skipped),
``sample_index``, ``token_ids`` (every generated token, a final stop token included), ``text``,
``logprobs``, ``finish_reason`` and ``prompt_tokens_dropped``; a verl row's ``data_source`` and
``ground_truth`` too, so that the completions can be scored offline as in training.

``text`` is the response as the trainers' reward functions read it: decoded with special tokens
skipped and without its final stop token, as vLLM's output text and verl's reward input are (not
transformers' default ``decode``, which keeps them); ``token_ids`` holds what was generated.

With ``rollout.multi_turn.enable`` (ppo's keys) each response is a trajectory with the tools of
``tool_config_path``, offered to the prompts' chat template, and its row adds what a samples.jsonl
row shows of one (``turns``, ``num_turns``, ``tool_calls``, ``tool_errors``, ``tool_rewards``);
``token_ids`` and ``text`` then hold the tools' results too, as the trainers' rewards read them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_rlhf.agent.config import MultiTurnConfig
from megatron_rlhf.agent.loop import AgentParts, ToolAgent
from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role, local_dir
from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.config.run import resolve_dtype
from megatron_rlhf.data import Tokenizer, load_prompt_dataset
from megatron_rlhf.data.builtin import resolve_data_paths
from megatron_rlhf.data.config import PromptRowsConfig
from megatron_rlhf.data.datasets import PromptExample
from megatron_rlhf.data.tokenizer import resolve_tokenizer, turn_end_warning
from megatron_rlhf.metrics.log import Progress, log
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.parallel.distributed import DistEnv, init_distributed
from megatron_rlhf.parallel.layout import layout_errors
from megatron_rlhf.rollout.engine import Completion
from megatron_rlhf.rollout.native import NativeEngine, generate_data_parallel
from megatron_rlhf.rollout.native_config import NativeEngineConfig
from megatron_rlhf.rollout.sampling import SamplingParams, stop_ids_errors
from megatron_rlhf.trainer.trajectories import trajectory_fields

UNBOUNDED_PROMPT = 1 << 30  # the engine, not the loader, applies the prompt-length policy


def policy_engine(
    model: str, arch: Architecture, *, tp: int, dtype: str, engine_cfg: NativeEngineConfig, env: DistEnv
) -> tuple[NativeEngine, Tokenizer]:
    """The causal LM at ``model`` built in a generation layout of ``tp`` ranks, its native engine
    (stopping on the tokenizer's stop ids unless ``engine_cfg`` names others) and its tokenizer.
    Collective."""
    role = build_role(
        "actor",
        ModelConfig(path=model, tp=tp),
        arch,
        world_size=env.world_size,
        dtype=resolve_dtype(dtype, env.device),
        device=env.device,
    )
    tokenizer = resolve_tokenizer(local_dir(model), arch, model)
    return NativeEngine(role, engine_cfg.with_eos_of(tokenizer.stop_ids)), tokenizer


def prompt_tools_file(tools_file: str, multi_turn: MultiTurnConfig | None) -> str:
    """The tools file prompts are rendered with: ``tools_file`` (``data.tools_file``), else the
    multi-turn agent's (the tools it runs), else none ("")."""
    return tools_file or (multi_turn.tool_config_path if multi_turn is not None and multi_turn.enable else "")


def generate_trajectories(
    engine: NativeEngine,
    tokenizer: Tokenizer,
    prompts: Sequence[PromptExample],
    params: SamplingParams,
    multi_turn: MultiTurnConfig | None = None,
    on_finished: Callable[[int], None] | None = None,
    template_variables: Mapping[str, Any] | None = None,
    own_tools: Mapping[str, int] | None = None,
) -> list[Completion]:
    """``generate_data_parallel`` of ``prompts``; with ``multi_turn`` enabled each completion is a
    trajectory with its tools (built here, their workers stopped on return), each prompt's
    ``tools_kwargs`` from its extras, the environment's turns rendered with the chat template's
    ``template_variables`` (those the prompts were rendered with); ``own_tools``: the tools the prompts
    offer through their own tools column (``DataReport.own_tools``), warned of where the agent does not
    run them. Collective."""
    ids = [example.prompt_ids.tolist() for example in prompts]
    if multi_turn is None or not multi_turn.enable:
        return generate_data_parallel(engine, ids, params, on_finished)
    parts = AgentParts.load(multi_turn)
    if warning := parts.unrendered_tools_warning(tokenizer):
        log(warning)
    if own_tools is not None and (warning := parts.foreign_tools_warning(own_tools)):
        log(warning)
    extras = [example.extras for example in prompts]
    with ToolAgent(multi_turn, tokenizer, parts.tools, extras, template_variables, parts.interactions) as agent:
        return generate_data_parallel(engine, ids, params, on_finished, agent=agent)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """``rows`` as JSONL, or as Parquet for a ``.parquet`` path, through a file beside it and a
    rename: a failure leaves the previous file, if any. Parquet's columns are every key of any row
    (null where a row lacks it); a column whose values pyarrow cannot give one type (a
    ``ground_truth`` that is text in one row and a number in another) holds them as JSON text."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        names = list(dict.fromkeys(key for row in rows for key in row))
        columns = {}
        for name in names:
            values = [row.get(name) for row in rows]
            try:
                columns[name] = pa.array(values)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                log(f"output={path}: column {name!r} holds values of several types: written as JSON text")
                columns[name] = pa.array([None if v is None else json.dumps(v) for v in values], pa.string())
        pq.write_table(pa.table(columns), partial)
    else:
        partial.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    os.replace(partial, path)


VERL_ROW = ("data_source", "ground_truth")
"""What a verl row's completions carry over to the output, for scoring them offline."""


def run_generate(
    *,
    model: str,
    input_path: str,
    output_path: str,
    data: PromptRowsConfig,
    tp: int,
    device: str,
    dtype: str,
    params: SamplingParams,
    engine_cfg: NativeEngineConfig,
    multi_turn: MultiTurnConfig,
) -> None:
    arch = architecture_of(model)
    env = init_distributed(device)
    errors = layout_errors("rollout", tp, 1, arch, env.world_size, pipeline=False)
    if arch.score_head:
        errors.append(f"model={model} is a {arch.hf_class_name}; generation needs a *ForCausalLM")
    errors += stop_ids_errors(params.stop_token_ids, engine_cfg.eos_token_ids, arch.vocab_size, "the model's")
    if errors:
        raise ConfigError("; ".join(errors))
    limit = arch.hf_config.get("max_position_embeddings")
    if limit is not None and engine_cfg.max_seq_len > limit:
        log(
            f"rollout.engine.max_seq_len={engine_cfg.max_seq_len} is past the model's max_position_embeddings="
            f"{limit}: a prompt and its completion stop at {limit} tokens (finish_reason length)"
        )
        engine_cfg = dataclasses.replace(engine_cfg, max_seq_len=limit)
    if Path(output_path).exists():
        log(f"output={output_path} exists: it is replaced once the completions are made")
    engine, tokenizer = policy_engine(model, arch, tp=tp, dtype=dtype, engine_cfg=engine_cfg, env=env)
    dataset, report = load_prompt_dataset(
        resolve_data_paths([input_path]),
        tokenizer,
        max_length=UNBOUNDED_PROMPT,
        on_invalid=data.on_invalid,
        prompt_key=data.prompt_key,
        add_bos=data.add_bos,
        **data.chat_options(prompt_tools_file(data.tools_file, multi_turn)),
        num_workers=data.num_workers,
        keep_raw_prompt=multi_turn.interactions_read_prompts,
    )
    log(report.summary())
    stops = params.stop_set(engine.cfg.eos_token_ids)
    warning = turn_end_warning(tokenizer, stops, data.chat_template_kwargs, "rollout.sampling.stop_token_ids")
    if warning and report.chat_prompts:
        log(warning)
    room = engine.cfg.max_seq_len - 1  # a prompt must leave room for one new token
    if engine.cfg.on_long_prompt == "error" and len(dataset) and int(dataset.lengths.max()) > room:
        long = [(row, n) for row, n in zip(dataset.rows, dataset.lengths.tolist(), strict=True) if n > room]
        row, n = long[0]
        raise ConfigError(
            f"input={input_path}: {len(long)} prompt(s) have more than rollout.engine.max_seq_len - 1 = {room} "
            f"tokens, the first row {row} (0-based, as prompt_index counts) with {n}: raise "
            "rollout.engine.max_seq_len, or set rollout.engine.on_long_prompt=truncate to drop their oldest tokens"
        )
    start = time.perf_counter()
    group_share = -(-len(dataset) // engine.role.groups.layout.dp) * params.n  # rank 0's data-parallel group
    progress = Progress("generate (data-parallel group 0)", group_share, "completions")
    rows = generate_trajectories(
        engine, tokenizer, dataset, params, multi_turn, progress, data.chat_template_kwargs, report.own_tools
    )
    elapsed = time.perf_counter() - start
    if env.rank == 0:
        new_tokens = sum(len(c.token_ids) for c in rows)
        stop_ids = params.stop_set(engine.cfg.eos_token_ids)
        trajectories = trajectory_fields(rows, tokenizer.decode_batch, stop_ids)
        prompts = tokenizer.decode_batch([c.prompt_ids for c in rows], skip_special_tokens=True)
        extras = dataset.extras
        write_rows(
            Path(output_path),
            [
                {
                    "prompt_index": dataset.rows[c.prompt_index],
                    "prompt": prompt,
                    **{k: extras[c.prompt_index][k] for k in VERL_ROW if k in extras[c.prompt_index]},
                    "sample_index": c.sample_index,
                    "token_ids": c.token_ids,
                    "text": tokenizer.decode(c.text_ids(stop_ids), skip_special_tokens=True),
                    "logprobs": c.logprobs,
                    "finish_reason": c.finish_reason,
                    "prompt_tokens_dropped": c.prompt_tokens_dropped,
                    **trajectory,
                }
                for c, prompt, trajectory in zip(rows, prompts, trajectories, strict=True)
            ],
        )
        dropped = sum(1 for c in rows if c.prompt_tokens_dropped)
        past_vocab = sum(i >= tokenizer.vocab_size for c in rows for i in c.token_ids)
        log(
            f"generated {len(rows)} completions for {len(dataset)} prompts ({new_tokens} tokens, "
            f"{new_tokens / max(elapsed, 1e-9):,.0f} tokens/s) -> {output_path}"
            + (f"; {dropped} prompts were truncated to fit max_seq_len" if dropped else "")
            + (
                f"; {past_vocab} sampled tokens have ids past the tokenizer's {tokenizer.vocab_size} (the model's "
                "padded vocabulary rows): token_ids keeps them, text has nothing of them"
                if past_vocab
                else ""
            )
        )
    dist.barrier()
