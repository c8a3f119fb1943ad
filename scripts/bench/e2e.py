"""Benchmark: RL steps end to end, each against its floor, and TRL's ``GRPOTrainer`` on the GRPO step.

    python scripts/bench/e2e.py --runs grpo-64 grpo-256 ppo-256 --trl-sequences 64 --out e2e.json

Each ``--runs`` entry is ALGORITHM-SEQUENCES (sequences per step = prompts x ``--n`` samples):

* ``grpo``: GRPO with a KL loss to the reference (the actor and the reference);
* ``ppo``: the four-model step: GAE with a critic (started from the actor's weights with a new score
  head), a reward model (``builtin:llama-1.5b-rm`` beside the default actor) mixed with the rule, and
  a KL penalty in the reward (which makes the actor's old log-probs a pass of their own).

One process runs, each in a subprocess of its own and on the same device:

1. our trainer as users run it (``torchrun --nproc-per-node 1 -m megatron_rlhf ppo --config
   ppo-grpo-1.5b ...``: bf16 on a GPU, one optimizer step per RL step), once per run, reading its
   ``metrics.jsonl``: step 1, the steady step (median of steps >= 3; a step is the sum of its
   ``timing_s/<phase>`` times), each phase and each phase's peak GPU memory;
2. the floor of each run's step from the device's bf16 matmul peak and memory copy rate, measured
   in this run (``roofline.py``, ``common.py``): each update at 6 N + 12 L h s FLOPs per token of
   its model (the critic's N has a score head for the LM head), each forward-only pass (reference
   and old log-probs, values, the reward model) at a third of its model's, prefill at the matmul
   peak, each decode step at its roofline (weights + KV cache so far read once, or its FLOPs,
   whichever takes longer), each Adam step at the memory rate; then step / floor, and each phase
   against its own floor;
3. TRL ``GRPOTrainer`` on the GRPO shape of ``--trl-sequences`` rows: the same HF checkpoint
   (``builtin:`` models are written to the cache as HF safetensors), the same prompts (each exactly
   ``--prompt-len`` tokens), the same number of sequences, samples per prompt and new tokens (EOS
   suppressed in both: ``ignore_eos`` / ``min_new_tokens``), the same reward rule
   (``lowercase_fraction``), one optimizer step per generation batch, KL beta 0.001 with a reference
   model, HF ``generate`` (no vLLM). Each configuration in ``--trl-configs``
   (``DTYPE-ATTN[-nockpt]``: bf16 or fp32 weights, which get bf16 autocast either way; eager or sdpa
   attention; TRL's default gradient checkpointing unless ``-nockpt``) runs ``--trl-steps`` steps:
   its step 1, steady step (median of steps >= 2), grad norms. Then our GRPO run of that shape /
   TRL's fastest steady step.

TRL's gradient norm on these random weights: see ``TRL_NAN_NOTE`` below (printed with the results). The
TRL worker checks step 1 for non-finite values (which layer's output first, which gradients) and
reports them under ``trl.<config>.nonfinite``.

``--profile`` runs each run's last step under torch.profiler (``profile_steps``) and prints where
each phase's time goes (GPU busy time, launches, costliest kernels); that step is not a steady one.
Each steady phase less its busy time is its idle time, and the sum of the busy times against the
floor is the ratio the step would reach with no idle time at all.

Progress lines carry the elapsed time. ``--skip-trl`` / ``--skip-ours`` leave a part out. On a CPU the
same script runs end to end on a tiny model (``--model builtin:tiny-llama --reward-model
builtin:tiny-llama-rm --runs grpo-8 ppo-8 --trl-sequences 8 --prompt-len 16 --new-tokens 16``; our
trainer then runs in fp32 CPU mode and the floor uses the CPU's fp32 rates).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import compute_dtype, copy_bandwidth, device_name, matmul_peak, median

START = time.perf_counter()
ALGORITHMS = ("grpo", "ppo")
TRL_CONFIGS = ("bf16-eager", "bf16-sdpa", "fp32-sdpa", "bf16-eager-nockpt")
KL_COEF = 0.001  # ppo-grpo-1.5b's algorithm.loss.kl_loss_coef; TRL's beta
TRL_NAN_NOTE = """\
TRL's NaN gradient norm (an earlier GPU run, trl 1.16.0, 64 sequences, builtin:llama-1.5b, a setup not
kept: NaN at step 1 in three configurations, step 2 crashed) did not recur with this script's setup:
finite on the CPU (bf16, the 1.5B widths and vocabulary, 2 or 8 layers) and on an H200 (28 layers,
bf16-eager and bf16-eager-nockpt, 4 steps; no non-finite module output or gradient at step 1). This
setup rules out completions cut short at EOS (min_new_tokens) and pad/eos/bos confusion (distinct ids,
passed as they are); the earlier run's cause is not known. The worker still checks step 1 and reports
any non-finite output or gradient under trl.<config>.nonfinite."""


def say(message: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f} s] {message}", flush=True)


# -------------------------------------------------------------------------------------------------
# Prompts: the same text for both trainers, each exactly prompt_len tokens of the model's tokenizer.


def write_prompts(path: Path, model_dir: Path, count: int, prompt_len: int) -> list[str]:
    """``count`` rows of lowercase words cut to exactly ``prompt_len`` tokens (checked with our
    tokenizer and with transformers' ``AutoTokenizer``, which TRL uses)."""
    from megatron_rlhf.data.records import write_jsonl
    from megatron_rlhf.data.tokenizer import load_tokenizer

    ours = load_tokenizer(model_dir)
    rng = random.Random(0)
    words = ["apple", "river", "stone", "cloud", "maple", "ocean", "tiger", "lemon", "piano", "crane"]
    texts = []
    for _ in range(count):
        text = ""
        while len(ours.encode(text)) < prompt_len + 8:
            text += rng.choice(words) + " "
        ids = ours.encode(text)[:prompt_len]
        text = ours.decode(ids)
        if len(ours.encode(text)) != prompt_len:
            raise ValueError(
                f"cannot make {prompt_len}-token prompts with this tokenizer (round trip changes the length)"
            )
        texts.append(text)
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(model_dir)
        lengths = {len(hf(t, add_special_tokens=False)["input_ids"]) for t in texts}
        if lengths != {prompt_len}:
            raise ValueError(f"AutoTokenizer gives prompt lengths {sorted(lengths)}, not {prompt_len}")
    except ImportError:
        pass
    write_jsonl([{"prompt": t} for t in texts], path)
    return texts


# -------------------------------------------------------------------------------------------------
# Subprocesses: their output goes to a log file; progress lines are echoed.


def run_logged(
    cmd: list[str], log_path: Path, echo: re.Pattern[str], timeout: float, env: dict[str, str] | None = None
) -> int:
    say(f"$ {' '.join(cmd)}  (log: {log_path})")
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout is not None
        deadline = time.perf_counter() + timeout
        for line in proc.stdout:
            log_file.write(line)
            if echo.search(line):
                say("  " + line[max(line.find("[trl]"), 0) :].rstrip()[:200])  # a TRL line from its tag on
            if time.perf_counter() > deadline:
                proc.kill()
                say(f"  killed after {timeout:.0f} s (--timeout)")
                break
        rc = proc.wait()
    if rc != 0:
        say(f"  exit status {rc}; last lines of {log_path}:")
        for line in log_path.read_text().splitlines()[-25:]:
            print("    " + line[:200])
    return rc


@dataclasses.dataclass(frozen=True)
class Run:
    """One of our runs: ALGORITHM-SEQUENCES (``--runs``)."""

    algorithm: str
    sequences: int

    @property
    def name(self) -> str:
        return f"{self.algorithm}-{self.sequences}"

    @classmethod
    def parse(cls, text: str, samples_per_prompt: int) -> Run:
        algorithm, _, sequences = text.partition("-")
        if algorithm not in ALGORITHMS or not sequences.isdigit():
            raise SystemExit(
                f"--runs entry '{text}': expected ALGORITHM-SEQUENCES, ALGORITHM one of {list(ALGORITHMS)}"
            )
        if int(sequences) % samples_per_prompt:
            raise SystemExit(
                f"--runs entry '{text}': {sequences} sequences is not a multiple of --n {samples_per_prompt}"
            )
        return cls(algorithm, int(sequences))


def algorithm_overrides(args: argparse.Namespace, run: Run) -> list[str]:
    """What turns the GRPO preset into the run's algorithm."""
    if run.algorithm == "grpo":
        return []
    return [
        "algorithm.advantage_estimator=gae",
        f"critic.path={args.model}",
        f"reward.path={args.reward_model}",
        "scoring.use_reward_model=true",
        f"algorithm.kl_penalty.coef={KL_COEF}",
        "algorithm.loss.kl_loss_coef=0.0",
    ]


def run_ours(args: argparse.Namespace, run: Run, prompts_file: Path, work: Path) -> dict[str, Any]:
    from megatron_rlhf.metrics.curves import read_metrics

    out_dir = work / run.name
    shutil.rmtree(out_dir, ignore_errors=True)
    prompts_per_step = run.sequences // args.n
    overrides = [
        "--config",
        "ppo-grpo-1.5b",
        f"output_dir={out_dir}",
        f"actor.path={args.model}",
        f"reference.path={args.model}",
        f"data.train=[{prompts_file}]",
        f"data.max_prompt_length={args.prompt_len}",
        f"rollout.sampling.max_new_tokens={args.new_tokens}",
        f"rollout.sampling.n={args.n}",
        "rollout.sampling.ignore_eos=true",
        f"prompts_per_step={prompts_per_step}",
        f"mini_batch_size={run.sequences}",
        f"rollout.engine.max_batch_size={run.sequences}",
        f"max_steps={args.steps}",
        f"log_every={args.steps}",
        f"max_tokens_per_micro_batch={args.max_tokens_per_micro_batch}",
        "save_hf=false",
        "save_final=false",
        "loggers=[console,jsonl]",
        *([f"profile_steps=[{args.steps}]"] if args.profile else []),
        *algorithm_overrides(args, run),
        *args.ours_override,
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        "--master-port",
        str(args.master_port),
        "-m",
        "megatron_rlhf",
        "ppo",
        *overrides,
    ]
    log_path = work / f"ours-{run.name}.log"
    rc = run_logged(cmd, log_path, re.compile(r"step \d+/\d+|Error|error:"), args.timeout)
    metrics_file = out_dir / "metrics.jsonl"
    rows = read_metrics(metrics_file)[0] if metrics_file.is_file() else []
    result: dict[str, Any] = {"command": " ".join(cmd), "exit_status": rc, "steps_run": len(rows)}
    warmup = re.search(r"\[warm-up[^\]]*\] ([0-9.]+)s", log_path.read_text())
    result["warmup_s"] = float(warmup.group(1)) if warmup else None  # start-up, before step 1 (GPU: warmup=auto)
    if not rows:
        return result
    # The step as the sum of its phases (timing_s/step, the wall time, also holds the metrics' host work).
    phases = [
        k.removeprefix("timing_s/")
        for k in rows[0]
        if k.startswith("timing_s/") and k.count("/") == 1 and k != "timing_s/step"
    ]
    steps = [sum(r[f"timing_s/{p}"] for p in phases) for r in rows]
    # The profiled step (--profile: the last) runs slower under the profiler: not a steady one.
    steady_rows = [r for r in rows if r["step"] >= 3 and not (args.profile and r["step"] == args.steps)] or rows[-1:]
    result.update(
        step_s=steps,
        step1_s=steps[0],
        steady_step_s=median([s for r, s in zip(rows, steps, strict=True) if r in steady_rows]),
        steady_from_step=steady_rows[0]["step"],
        phases_step1_s={p: rows[0][f"timing_s/{p}"] for p in phases},
        phases_steady_s={p: median([r[f"timing_s/{p}"] for r in steady_rows]) for p in phases},
        sub_phases_steady_s={
            k.removeprefix("timing_s/"): median([r.get(k, 0.0) for r in steady_rows])
            for k in rows[0]
            if k.startswith("timing_s/gen/") and k != "timing_s/gen/std"
        },
        grad_norm=[r.get("actor/grad_norm") for r in rows],
        response_length=[r.get("response_length/mean") for r in rows],
        gen_tokens_per_s=[r.get("perf/gen_tokens_per_s") for r in rows],
        # The engine's sampling log-probs against the trainer's on the response, per step: the sampler's
        # check in a real run.
        rollout_logprob_max_abs_diff=[r.get("rollout/logprob_max_abs_diff") for r in rows],
        # Each phase's allocator peaks over the steady steps (GiB; GPU only).
        peak_gib={
            k.removeprefix("memory/peak_"): max(r.get(k, 0.0) for r in steady_rows)
            for k in rows[0]
            if k.startswith(("memory/peak_allocated_gib/", "memory/peak_reserved_gib/"))
        },
    )
    profile = out_dir / "profile" / f"step_{args.steps}"
    if profile.with_suffix(".txt").is_file():
        result["profile"] = {"step": args.steps, "phases": profile.with_suffix(".txt").read_text()}
        busy: dict[str, float] = {}  # a phase may be timed in several ranges (reward: the rule wait, the model)
        for phase in json.loads(profile.with_suffix(".json").read_text())["phases"]:
            if phase["depth"] == 0:
                busy[phase["name"]] = busy.get(phase["name"], 0.0) + phase["busy_ms"] / 1e3
        result["profile"]["busy_s"] = busy
    return result


def run_trl(args: argparse.Namespace, config: str, prompts_file: Path, work: Path) -> dict[str, Any]:
    out = work / f"trl-{config}.json"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        __file__,
        "--trl-worker",
        config,
        "--trl-prompts",
        str(prompts_file),
        "--trl-json",
        str(out),
        "--model",
        args.model,
        "--trl-sequences",
        str(args.trl_sequences),
        "--n",
        str(args.n),
        "--new-tokens",
        str(args.new_tokens),
        "--trl-steps",
        str(args.trl_steps),
        "--trl-micro-batch",
        str(args.trl_micro_batch),
        "--work-dir",
        str(work),
    ]
    rc = run_logged(cmd, work / f"trl-{config}.log", re.compile(r"\[trl\]|Error"), args.timeout)
    result = json.loads(out.read_text()) if out.is_file() else {}
    return {"exit_status": rc, **result}


# -------------------------------------------------------------------------------------------------
# The TRL worker (a subprocess: ``--trl-worker CONFIG``).


def trl_worker(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_rlhf.checkpoint.sources import local_dir
    from megatron_rlhf.rewards.rules import REWARD_RULES, Sample

    dtype_name, attn, *rest = args.trl_worker.split("-")
    if dtype_name not in ("bf16", "fp32") or attn not in ("eager", "sdpa") or rest not in ([], ["nockpt"]):
        raise ValueError(f"--trl-configs entry '{args.trl_worker}': expected (bf16|fp32)-(eager|sdpa)[-nockpt]")
    model_dir = str(local_dir(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [json.loads(line)["prompt"] for line in Path(args.trl_prompts).read_text().splitlines()]
    rule = REWARD_RULES.get("lowercase_fraction")

    def reward(completions: list[str], completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [
            rule(
                Sample(
                    prompt_ids=[],
                    response_ids=ids,
                    prompt_text="",
                    response_text=text,
                    finish_reason="length",
                    extras={},
                )
            )
            for text, ids in zip(completions, completion_ids, strict=True)
        ]

    sequences = args.trl_sequences
    micro = min(args.trl_micro_batch or sequences, sequences)
    if sequences % micro:
        raise ValueError(f"--trl-micro-batch {micro} must divide --trl-sequences {sequences}")
    accumulation = sequences // micro
    on_gpu = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=str(Path(args.work_dir) / f"trl-{args.trl_worker}"),
        report_to=[],
        save_strategy="no",
        seed=0,
        max_steps=args.trl_steps,
        logging_steps=1,
        learning_rate=1e-6,
        use_cpu=not on_gpu,
        # One optimizer step per generation batch of `sequences` completions: TRL generates
        # per_device_train_batch_size * steps_per_generation completions at once, and steps the
        # optimizer every gradient_accumulation_steps micro-batches.
        per_device_train_batch_size=micro,
        steps_per_generation=accumulation,
        gradient_accumulation_steps=accumulation,
        num_generations=args.n,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        generation_kwargs={"min_new_tokens": args.new_tokens},  # as our ignore_eos: every completion is full length
        beta=KL_COEF,
        bf16=True,
        gradient_checkpointing=rest != ["nockpt"],
        model_init_kwargs={"dtype": "bfloat16" if dtype_name == "bf16" else "float32", "attn_implementation": attn},
    )
    record: dict[str, Any] = {
        "config": args.trl_worker,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": accumulation,
        "logs": [],
        "step_end_s": [],
    }

    class Timing(TrainerCallback):
        """Wall time of every optimizer step (generation included), its logs, and at step 1 where
        non-finite values first appear (forward hooks on every module; gradients before the step)."""

        def __init__(self) -> None:
            self.hooks: list[Any] = []

        def on_train_begin(self, _args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            record["train_begin"] = time.perf_counter()
            seen = record.setdefault("nonfinite", {"first_output": None, "grads": []})

            def check(name: str):
                def hook(_module: Any, _inputs: Any, output: Any) -> None:
                    tensor = output[0] if isinstance(output, tuple) else getattr(output, "logits", output)
                    if (
                        seen["first_output"] is None
                        and torch.is_tensor(tensor)
                        and not bool(torch.isfinite(tensor).all())
                    ):
                        seen["first_output"] = f"{name} (grad {'on' if torch.is_grad_enabled() else 'off'})"

                return hook

            self.hooks = [
                m.register_forward_hook(check(n or "model")) for n, m in model.named_modules() if n.count(".") <= 2
            ]

        def on_pre_optimizer_step(self, _args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            if state.global_step == 0:
                bad = [
                    n
                    for n, p in model.named_parameters()
                    if p.grad is not None and not bool(torch.isfinite(p.grad).all())
                ]
                record["nonfinite"]["grads"] = bad[:20] + ([f"... {len(bad)} in all"] if len(bad) > 20 else [])

        def on_step_end(self, _args: Any, state: Any, control: Any, **_: Any) -> None:
            record["step_end_s"].append(time.perf_counter() - record["train_begin"])
            for hook in self.hooks:  # step 1 only: the checks synchronise with the device
                hook.remove()
            self.hooks = []
            steps = record["step_end_s"]
            print(
                f"[trl] {args.trl_worker} step {len(steps)}/{args.trl_steps}: "
                f"{steps[-1] - (steps[-2] if len(steps) > 1 else 0):.2f} s",
                flush=True,
            )

        def on_log(self, _args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
            if logs and "grad_norm" in logs:
                record["logs"].append(
                    {
                        k: logs.get(k)
                        for k in (
                            "loss",
                            "grad_norm",
                            "kl",
                            "entropy",
                            "reward",
                            "reward_std",
                            "completions/mean_length",
                            "step_time",
                        )
                    }
                )
                print(
                    f"[trl]   grad_norm {logs.get('grad_norm')} loss {logs.get('loss')} kl {logs.get('kl')}", flush=True
                )

    def save() -> None:
        ends = record["step_end_s"]
        steps = [b - a for a, b in zip([0.0, *ends[:-1]], ends, strict=True)]  # each step from the last one's end
        record.update(
            step_s=steps,
            step1_s=steps[0] if steps else None,
            steady_step_s=median(steps[1:]),
            grad_norm=[entry["grad_norm"] for entry in record["logs"]],
        )
        Path(args.trl_json).write_text(json.dumps(record, indent=2, default=str) + "\n")

    load_start = time.perf_counter()
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        args=config,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        callbacks=[Timing()],
    )
    record["load_s"] = time.perf_counter() - load_start
    record["pad_eos_bos"] = [tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id]
    try:
        trainer.train()
    except Exception as error:  # a NaN step makes the next generation fail: keep the steps so far
        record["error"] = f"{type(error).__name__}: {error}"[:500]
        print(f"[trl] {args.trl_worker} stopped: {record['error']}", flush=True)
    save()
    if "error" in record:
        sys.exit(1)


# -------------------------------------------------------------------------------------------------
# The floor and the report.


def measure_device() -> dict[str, Any]:
    """The device's ceilings, measured once for every run's floor."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = compute_dtype(device)  # the trainer's dtype=auto
    return {
        "device": device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "dtype_bytes": torch.finfo(dtype).bits // 8,
        "matmul_peak_TFLOPs": matmul_peak(device, dtype) / 1e12,
        "copy_bandwidth_TBps": copy_bandwidth(device) / 1e12,
    }


def run_floor(args: argparse.Namespace, run: Run, phases: list[str], ceilings: dict[str, Any]) -> dict[str, Any]:
    """The floor of the run's step and of each of its phases (``phases``: those the step ran)."""
    from roofline import ModelWork, StepShape, forward_seconds, rl_step_floor, update_seconds

    from megatron_rlhf.checkpoint.sources import architecture_of

    policy_arch = architecture_of(args.model)
    policy = ModelWork.of(policy_arch, dtype_bytes=ceilings["dtype_bytes"])
    critic = ModelWork.of(policy_arch.with_score_head(), dtype_bytes=ceilings["dtype_bytes"])
    reward = ModelWork.of(architecture_of(args.reward_model), dtype_bytes=ceilings["dtype_bytes"])
    rates = {
        "flops_per_s": ceilings["matmul_peak_TFLOPs"] * 1e12,
        "bytes_per_s": ceilings["copy_bandwidth_TBps"] * 1e12,
    }
    shape = StepShape(num_sequences=run.sequences, prompt_len=args.prompt_len, response_len=args.new_tokens)
    # Each forward-only phase's model; the reward phase is the reward model's pass (rules count zero).
    forward_of = {"ref": policy, "old_log_prob": policy, "values": critic}
    if run.algorithm == "ppo":
        forward_of["reward"] = reward
    updated = {"update_actor": policy, "update_critic": critic}
    step = rl_step_floor(
        policy,
        shape,
        **rates,
        forward_passes=[work for phase, work in forward_of.items() if phase in phases],
        updated=[work for phase, work in updated.items() if phase in phases],
    )
    per_phase = {"gen": step["generate"]}
    per_phase |= {p: forward_seconds(w, shape, flops_per_s=rates["flops_per_s"]) for p, w in forward_of.items()}
    per_phase |= {p: sum(update_seconds(w, shape, **rates).values()) for p, w in updated.items()}
    return {
        "params": {"policy": policy.params, "critic": critic.params, "reward": reward.params},
        "step": step,
        "phases": {p: per_phase[p] for p in phases if p in per_phase},
    }


def report(result: dict[str, Any]) -> None:
    def fmt(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

    print("\n== " + ", ".join(f"{k} {result[k]}" for k in ("model", "reward_model", "n", "prompt_len", "new_tokens")))
    dev = result["device"]
    print(
        f"device {dev['device']} ({dev['dtype']}; matmul {dev['matmul_peak_TFLOPs']:.4g} TFLOP/s, copy "
        f"{dev['copy_bandwidth_TBps']:.4g} TB/s)"
    )
    for name, entry in result["runs"].items():
        ours, floor = entry["ours"], entry.get("floor", {})
        print(f"\n-- {name}")
        if not ours.get("steps_run"):
            print(f"  no step ran (exit status {ours.get('exit_status')})")
            continue
        print(
            f"ours: step 1 {fmt(ours['step1_s'])} s, steady (median of steps >= {ours['steady_from_step']}) "
            f"{fmt(ours['steady_step_s'])} s; steps {[round(s, 3) for s in ours['step_s']]}; start-up warm-up "
            f"{fmt(ours.get('warmup_s'))} s"
        )
        peaks = ours.get("peak_gib", {})
        print(f"  {'phase':<16}{'step 1':>10}{'steady':>10}{'floor':>10}{'ratio':>8}{'peak GiB':>10}{'reserved':>10}")
        for phase, steady in ours["phases_steady_s"].items():
            phase_floor = floor.get("phases", {}).get(phase)
            print(
                f"  {phase:<16}{fmt(ours['phases_step1_s'][phase]):>10}{fmt(steady):>10}{fmt(phase_floor):>10}"
                f"{fmt(steady / phase_floor) if phase_floor else '-':>8}"
                f"{fmt(peaks.get(f'allocated_gib/{phase}')):>10}{fmt(peaks.get(f'reserved_gib/{phase}')):>10}"
            )
        print(
            f"  grad norms {ours['grad_norm']}; engine vs trainer log-probs, max abs diff per step "
            f"{ours['rollout_logprob_max_abs_diff']}"
        )
        if floor:
            print("  floor: " + ", ".join(f"{k} {v:.4f}" for k, v in floor["step"].items()))
            print(
                f"  ours steady / floor: {entry['ours_over_floor']:.2f}; "
                f"step 1 / steady: {entry['step1_over_steady']:.2f}"
            )
        if "busy_s" in ours.get("profile", {}):
            busy = ours["profile"]["busy_s"]
            print(
                "  device busy in the profiled step, and the rest of each steady phase (idle): "
                + ", ".join(
                    f"{p} {busy.get(p, 0.0):.3f} / {s - busy.get(p, 0.0):.3f}"
                    for p, s in ours["phases_steady_s"].items()
                )
            )
            if floor:
                print(
                    f"  with no idle time the step would be {entry['busy_s']:.3f} s, "
                    f"{entry['busy_over_floor']:.2f}x its floor"
                )
        if ours.get("profile"):
            print(
                f"  profile of step {ours['profile']['step']} (not in the steady median):\n{ours['profile']['phases']}"
            )
    for config, trl in result.get("trl", {}).items():
        print(
            f"TRL {config} ({result['trl_sequences']} sequences): step 1 {fmt(trl.get('step1_s'))} s, steady "
            f"{fmt(trl.get('steady_step_s'))} s, grad norm {trl.get('grad_norm')}"
            + (f", error: {trl['error']}" if trl.get("error") else "")
            + (
                f", non-finite: {trl['nonfinite']}"
                if (trl.get("nonfinite") or {}).get("first_output") or (trl.get("nonfinite") or {}).get("grads")
                else ""
            )
        )
    if result.get("trl_fastest"):
        print(
            f"TRL fastest: {result['trl_fastest']}; ours (grpo-{result['trl_sequences']}) / TRL (steady): "
            f"{fmt(result.get('ours_over_trl_steady'))}, (step 1): {fmt(result.get('ours_over_trl_step1'))}"
        )
    if "trl" in result:
        print("\n" + TRL_NAN_NOTE)


def compare_with_trl(result: dict[str, Any]) -> None:
    """TRL's fastest configuration (by steady step; by step 1 when none got past it) against our
    GRPO run of the same shape."""
    trl_runs = {c: t for c, t in result["trl"].items() if t.get("step1_s")}
    key = "steady_step_s" if any(t.get("steady_step_s") for t in trl_runs.values()) else "step1_s"
    trl_runs = {c: t for c, t in trl_runs.items() if t.get(key)}
    if not trl_runs:
        return
    fastest = min(trl_runs, key=lambda c: trl_runs[c][key])
    result["trl_fastest"] = fastest
    ours = result["runs"].get(f"grpo-{result['trl_sequences']}", {}).get("ours", {})
    if ours.get("steady_step_s") and trl_runs[fastest].get("steady_step_s"):
        result["ours_over_trl_steady"] = ours["steady_step_s"] / trl_runs[fastest]["steady_step_s"]
    if ours.get("step1_s"):
        result["ours_over_trl_step1"] = ours["step1_s"] / trl_runs[fastest]["step1_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:llama-1.5b")
    parser.add_argument("--reward-model", default="builtin:llama-1.5b-rm", help="the ppo runs' reward model")
    parser.add_argument("--runs", nargs="+", default=["grpo-256"], help="ALGORITHM-SEQUENCES, ALGORITHM grpo or ppo")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="our trainer's steps per run")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=16384)
    parser.add_argument("--ours-override", nargs="*", default=[], help="extra config overrides for our trainer")
    parser.add_argument("--trl-sequences", type=int, default=64, help="TRL's GRPO step: sequences (prompts x --n)")
    parser.add_argument("--trl-steps", type=int, default=3)
    parser.add_argument("--trl-configs", nargs="+", default=list(TRL_CONFIGS), help="(bf16|fp32)-(eager|sdpa)[-nockpt]")
    parser.add_argument("--trl-micro-batch", type=int, default=0, help="TRL's per-device batch (0: all sequences)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile each run's last step (profile_steps): its phase report is printed and kept in the JSON; "
        "that step is left out of the steady median",
    )
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-ours", action="store_true")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for each subprocess")
    parser.add_argument("--master-port", type=int, default=29517)
    parser.add_argument("--work-dir", type=Path, default=Path("runs/bench_e2e"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--trl-prompts", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--trl-json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args)
    runs = [Run.parse(text, args.n) for text in args.runs]
    if args.trl_sequences % args.n:
        raise SystemExit(f"--trl-sequences {args.trl_sequences} is not a multiple of --n {args.n}")

    from megatron_rlhf.checkpoint.sources import local_dir

    args.work_dir.mkdir(parents=True, exist_ok=True)
    say(f"materialising {args.model}")
    model_dir = local_dir(args.model)
    if any(run.algorithm == "ppo" for run in runs):
        say(f"materialising {args.reward_model}")
        local_dir(args.reward_model)
    prompts_file = args.work_dir / "prompts.jsonl"
    most = max([run.sequences for run in runs] + [args.trl_sequences])
    write_prompts(prompts_file, model_dir, max(most // args.n * max(args.steps, args.trl_steps), 64), args.prompt_len)
    result: dict[str, Any] = {
        "model": args.model,
        "model_dir": str(model_dir),
        "reward_model": args.reward_model,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "runs": {},
    }
    if not args.skip_ours:
        for run in runs:
            say(f"our trainer, {run.name}: {args.steps} steps")
            result["runs"][run.name] = {"ours": run_ours(args, run, prompts_file, args.work_dir)}
    if not args.skip_trl:
        result["trl_sequences"] = args.trl_sequences
        result["trl"] = {}
        for config in args.trl_configs:
            say(f"TRL GRPOTrainer {config}, {args.trl_sequences} sequences: {args.trl_steps} steps")
            result["trl"][config] = run_trl(args, config, prompts_file, args.work_dir)
        result["trl_nan_note"] = TRL_NAN_NOTE
    say("device ceilings (matmul, copy)")
    result["device"] = measure_device()
    for run in runs:
        entry = result["runs"].get(run.name)
        if not entry or not entry["ours"].get("steps_run"):
            continue
        ours = entry["ours"]
        entry["floor"] = run_floor(args, run, list(ours["phases_steady_s"]), result["device"])
        entry["ours_over_floor"] = ours["steady_step_s"] / entry["floor"]["step"]["step"]
        entry["step1_over_steady"] = ours["step1_s"] / ours["steady_step_s"]
        if "busy_s" in ours.get("profile", {}):  # what no overlap of host and device work can go under
            entry["busy_s"] = sum(ours["profile"]["busy_s"].get(p, 0.0) for p in ours["phases_steady_s"])
            entry["busy_over_floor"] = entry["busy_s"] / entry["floor"]["step"]["step"]
    if "trl" in result:
        compare_with_trl(result)
    report(result)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
