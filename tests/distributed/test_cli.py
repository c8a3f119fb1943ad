"""The command line as a user runs it: subprocesses, exit codes, files on disk.

``CASES`` declares the runs that are one command each: its flags, the exit it must end with, what its
output must say and which files it must not leave; one runner launches them all. A case whose check
is more than that names a small check function. A case that ends before any model is built calls the
CLI's ``main`` in this process; the others run as a user runs them. Runs that compare two launches
follow the table.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.distributed.test_ppo_verl import _verl_parquet
from tests.distributed.test_sft_rm import _preference_rows, _write_jsonl
from tests.helpers import PAD_ID, hf_classes, make_chat_tokenizer, make_tiny_hf_model
from tests.launch import run_cli, run_cli_here

Check = Callable[[Path, subprocess.CompletedProcess], None]
"""A case's own assertions: its directory and the finished process."""


@dataclass(frozen=True)
class CliCase:
    """One command line and what it must do. In ``args`` and the expected texts, ``{tmp}`` stands for
    the case's own directory, where ``files`` are written (name -> contents) before the run."""

    name: str
    description: str
    args: tuple[str, ...]
    exit_code: int | None = 0  # None: any failure
    nproc: int = 1
    files: dict[str, str] = field(default_factory=dict)
    prepare: Callable[[Path], object] | None = None  # inputs that are more than a text file
    stdout_has: tuple[str, ...] = ()
    stdout_lacks: tuple[str, ...] = ()
    stderr_has: tuple[str, ...] = ()
    stderr_once: tuple[str, ...] = ()  # said once in all, not once by every rank
    absent: tuple[str, ...] = ()  # paths under {tmp} that the run must not create
    check: Check | None = None
    quotes_a_traceback: bool = False  # a failure that prints one: torchrun's, or the user's code's
    builds_models: bool = True  # a subprocess, marked ``distributed``; else a call of ``main`` here


def _every_command_listed_and_config_not(tmp: Path, proc: subprocess.CompletedProcess) -> None:
    listed = {line.split()[0] for line in proc.stdout.splitlines() if line.startswith("    ") and line[4] != " "}
    assert listed >= {"smoke", "ppo", "sft", "rm", "pipeline", "generate", "plan", "convert"}, listed
    assert "config" not in listed


def _defaults_without_config_are_named(tmp: Path, proc: subprocess.CompletedProcess) -> None:
    assert "(default: none, the library defaults)" in " ".join(proc.stdout.split())  # argparse wraps lines


def _verl_parquet_in(tmp: Path) -> None:
    _verl_parquet(tmp / "train.parquet", 8)


def _rm_rows_in(tmp: Path) -> None:
    _write_jsonl(tmp / "train.jsonl", _preference_rows(16, 2))


def _error_names_the_exiting_function(tmp: Path, proc: subprocess.CompletedProcess) -> None:
    error = proc.stderr[proc.stderr.index("megatron-rlhf: error: ") :]
    assert error.startswith(
        f"megatron-rlhf: error: custom reward function 'compute_score' ({tmp / 'exits.py'}) on sample 0 "
        "(data_source 'openai/gsm8k', response "
    )
    assert f'File "{tmp / "exits.py"}", line 5, in compute_score' in error
    assert error.rstrip().endswith("SystemExit: 0")


BUILT = "build+load"
"""What a run prints once it has built its models."""


def _hf_dir(tmp: Path) -> None:
    """A tiny HF Llama at ``tmp/hf``, for the convert cases."""
    make_tiny_hf_model("llama", False, tmp / "hf")


ROW_FOR_EVERY_TRAINER = '{"prompt": "a", "response": "b", "chosen": "b", "rejected": "c"}\n'
VERL_PPO = (
    "ppo",
    "--config",
    "ppo-tiny",
    "data.train=[{tmp}/train.parquet]",
    "max_steps=2",
    "prompts_per_step=4",
    "scoring.use_reward_model=false",
    "scoring.rules=[]",
    "data.apply_chat_template=false",
    "data.prompt_key=ability",
    "output_dir={tmp}/run",
)

CASES: list[CliCase] = [
    CliCase(
        "help",
        "--help lists every command (and no longer config)",
        ("--help",),
        check=_every_command_listed_and_config_not,
        builds_models=False,
    ),
    CliCase(
        "rm_help",
        "a trainer's help names its demo preset and says what runs without --config",
        ("rm", "--help"),
        stdout_has=("a preset name (rm-tiny)",),
        check=_defaults_without_config_are_named,
        builds_models=False,
    ),
    CliCase(
        "print_config_override",
        "--print-config prints the tree with the overrides applied, each key under its description",
        ("smoke", "--print-config", "dtype=fp32", "seed=7"),
        stdout_has=("\ndtype: fp32\n", "# Seeds the data order, sampling and everything random.\nseed: 7\n"),
        builds_models=False,
    ),
    CliCase(
        "config_is_gone",
        "the config command says in one line what replaces it",
        ("config", "actor.tp=2"),
        exit_code=2,
        stderr_has=("use 'megatron-rlhf <command> --print-config'",),
        builds_models=False,
    ),
    CliCase(
        "unknown_key",
        "a misspelt key is refused with the nearest real one",
        ("smoke", "actor.tpp=2"),
        exit_code=2,
        stderr_has=(
            "unknown key 'actor.tpp'; did you mean",
            "actor.tp",
            "valid keys here: ['path', 'tp', 'pp', 'lora']",
        ),
        builds_models=False,
    ),
    CliCase(
        "key_as_a_flag",
        "a key written as a flag is answered with its key=value form, in the command's usage",
        ("ppo", "--config", "ppo-tiny", "--max_steps", "3"),
        exit_code=2,
        stderr_has=("usage: megatron-rlhf ppo ", "megatron-rlhf ppo: error: settings are key=value: max_steps=3"),
        builds_models=False,
    ),
    CliCase(
        "invalid_layout",
        "a layout that cannot divide the model is reported once, before anything is built",
        ("smoke", "output_dir={tmp}/run", "reference.tp=4"),
        nproc=4,
        exit_code=None,
        quotes_a_traceback=True,
        stderr_once=("reference.tp=4 must divide num_key_value_heads=2 (model builtin:tiny-llama)",),
        stdout_lacks=(BUILT,),
    ),
    CliCase(
        "convert_tp_not_dividing_heads",
        "convert refuses a TP that divides neither head count, and writes nothing",
        ("convert", "hf-to-mcore", "{tmp}/hf", "{tmp}/ckpt", "tp=3"),
        exit_code=2,
        prepare=_hf_dir,
        stderr_has=("tp=3 must divide num_attention_heads=4", "tp=3 must divide num_key_value_heads=2"),
        absent=("ckpt",),
        builds_models=False,
    ),
    CliCase(
        "convert_into_a_non_empty_directory",
        "convert refuses an output holding files: another model's weights beside the converted ones would mix",
        ("convert", "hf-to-mcore", "{tmp}/hf", "{tmp}/hf"),
        exit_code=2,
        prepare=_hf_dir,
        stderr_has=("output {tmp}/hf is the source: give a new directory",),
        builds_models=False,
    ),
    CliCase(
        "convert_an_hf_directory_as_a_checkpoint",
        "mcore-to-hf names what it expected of its source",
        ("convert", "mcore-to-hf", "{tmp}/hf", "{tmp}/out"),
        exit_code=2,
        prepare=_hf_dir,
        stderr_has=("{tmp}/hf: no megatron_rlhf.json here, so not a megatron-rlhf model checkpoint",),
        absent=("out",),
        builds_models=False,
    ),
    CliCase(
        "generate_over_its_input",
        "generate refuses to write its completions over its prompts",
        ("generate", "model=builtin:tiny-llama", "input={tmp}/p.jsonl", "output={tmp}/p.jsonl"),
        exit_code=2,
        files={"p.jsonl": '{"prompt": "hi"}\n'},
        stderr_has=("output={tmp}/p.jsonl is the input: the completions would replace the prompts",),
        builds_models=False,
    ),
    CliCase(
        "generate_missing_column",
        "generate names the file and the column a prompt row lacks",
        ("generate", "model=builtin:tiny-llama", "input={tmp}/bad.jsonl", "output={tmp}/o.jsonl"),
        exit_code=2,
        files={"bad.jsonl": '{"question": "hi"}\n'},
        stderr_has=("{tmp}/bad.jsonl", "prompt"),
        builds_models=False,
    ),
    CliCase(
        "generate_without_model",
        "generate names the required setting it lacks",
        ("generate", "input={tmp}/p.jsonl", "--output", "{tmp}/o.jsonl"),
        exit_code=2,
        stderr_has=("model is not set. Required: the policy",),
        absent=("o.jsonl",),
        builds_models=False,
    ),
    CliCase(
        "generate_output_format",
        "generate names the output formats it writes (before: any name got JSONL, output=x.parquet included)",
        ("generate", "model=builtin:tiny-llama", "input={tmp}/p.jsonl", "output={tmp}/o.csv"),
        exit_code=2,
        files={"p.jsonl": '{"prompt": "hi"}\n'},
        stderr_has=("output={tmp}/o.csv: expected a .jsonl or .parquet file name",),
        builds_models=False,
    ),
    CliCase(
        "generate_stop_id_outside_the_vocabulary",
        "generate refuses stop ids the model can never sample, as ppo does",
        (
            "generate",
            "model=builtin:tiny-llama",
            "input={tmp}/p.jsonl",
            "output={tmp}/o.jsonl",
            "--stop-token-ids",
            "99999",
        ),
        exit_code=2,
        files={"p.jsonl": '{"prompt": "hi"}\n'},
        stderr_has=("rollout.sampling.stop_token_ids=[99999] holds ids outside the model's vocabulary",),
        absent=("o.jsonl",),
        builds_models=False,
    ),
    CliCase(
        "generate_tp_not_dividing_heads",
        "generate names its layout setting in key=value form",
        ("generate", "model=builtin:tiny-llama", "input={tmp}/p.jsonl", "output={tmp}/o.jsonl", "--tp", "3"),
        exit_code=2,
        files={"p.jsonl": '{"prompt": "hi"}\n'},
        stderr_has=("rollout.tp=3 must divide num_attention_heads=4",),
        absent=("o.jsonl",),
        builds_models=False,
    ),
    *(
        CliCase(
            f"{command}_output_dir_under_a_file",
            "an output_dir below a file is a named error, not a traceback",
            (command, "--config", f"{command}-tiny", "output_dir={tmp}/somefile/run", "data.train=[{tmp}/rows.jsonl]"),
            exit_code=2,
            files={"somefile": "", "rows.jsonl": ROW_FOR_EVERY_TRAINER},
            stderr_has=("output_dir='{tmp}/somefile/run': {tmp}/somefile is a file, not a directory",),
            stdout_lacks=(BUILT,),
            builds_models=False,
        )
        for command in ("ppo", "sft", "rm")
    ),
    *(
        CliCase(
            f"{command}_missing_dataset",
            "a dataset path that does not exist fails before the run writes or builds anything",
            (command, "--config", f"{command}-tiny", "output_dir={tmp}/run", "data.train=[/nope.jsonl]"),
            exit_code=2,
            stderr_has=("data.train: dataset path '/nope.jsonl' does not exist",),
            stdout_lacks=(BUILT,),
            absent=("run",),  # no config.yaml left behind
            builds_models=False,
        )
        for command in ("ppo", "sft", "rm")
    ),
    *(
        CliCase(
            f"{command}_rows_without_columns",
            "rows without the trainer's columns fail before the run writes or builds anything",
            (command, "--config", f"{command}-tiny", "output_dir={tmp}/run", "data.train=[{tmp}/rows.jsonl]"),
            exit_code=2,
            files={"rows.jsonl": '{"question": "a"}\n'},
            stderr_has=("{tmp}/rows.jsonl", "column 'prompt' is missing"),
            stdout_lacks=(BUILT,),
            absent=("run",),
            builds_models=False,
        )
        for command in ("ppo", "sft", "rm")
    ),
    *(
        CliCase(
            f"sft_missing_response_column_{num_workers}_workers",
            "the same message whether the row is read here or in a data-loading worker process",
            (
                "sft",
                "--config",
                "sft-tiny",
                "data.train=[{tmp}/no-response.jsonl]",
                "output_dir={tmp}/run",
                f"data.num_workers={num_workers}",
            ),
            exit_code=2,
            files={"no-response.jsonl": '{"prompt": "a b c =", "answer": " c b a"}\n'},
            stderr_has=("{tmp}/no-response.jsonl", "column 'response' is missing"),
        )
        for num_workers in (0, 2)
    ),
    CliCase(
        "sft_lora",
        "sft with LoRA adapters trains, checkpoints, says how many parameters train, and writes no HF model "
        "(TP2 and PP2: tests/distributed/test_lora.py)",
        (
            "sft",
            "--config",
            "sft-tiny",
            "data.train=[{tmp}/train.jsonl]",
            "model.lora.rank=8",
            "save_hf=false",
            "max_steps=2",
            "output_dir={tmp}/run",
        ),
        files={"train.jsonl": "".join(f'{{"prompt": "{i}+{i}=", "response": "{2 * i}"}}\n' for i in range(32))},
        stdout_has=("M parameters (LoRA rank 8: 0.075M trained) on rank 0", "step 2: saved checkpoint", "sft done"),
        absent=("run/hf",),
    ),
    CliCase(
        "rm_global_batch_not_divisible_by_dp",
        "a global batch that DP cannot split is a config error, said once by rank 0",
        ("rm", "--config", "rm-tiny", "data.train=[{tmp}/train.jsonl]", "global_batch_size=3", "output_dir={tmp}/run"),
        nproc=2,
        exit_code=None,
        prepare=_rm_rows_in,
        quotes_a_traceback=True,
        stderr_once=("global_batch_size=3 must be divisible by the data-parallel size dp=2",),
        stdout_lacks=(BUILT,),
    ),
    CliCase(
        "verl_reward_function_exits",
        "a compute_score that calls sys.exit(0) ends the run with exit 2 and the function's error (it used to "
        "end it with exit 0, no message and no model)",
        (*VERL_PPO, "scoring.custom_function.path={tmp}/exits.py"),
        exit_code=2,
        files={
            "exits.py": "import sys\n\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
            "    sys.exit(0)\n"
        },
        prepare=_verl_parquet_in,
        absent=("run/hf",),
        quotes_a_traceback=True,
        check=_error_names_the_exiting_function,
    ),
    CliCase(
        "verl_gsm8k_signature",
        "a compute_score with verl's gsm8k signature (no data_source, no extra_info) is refused before anything "
        "is built",
        (*VERL_PPO, "scoring.custom_function.path={tmp}/gsm8k.py"),
        exit_code=2,
        files={
            "gsm8k.py": "def compute_score(solution_str, ground_truth, method='strict', format_score=0.0, "
            "score=1.0):\n    return 0.0\n"
        },
        prepare=_verl_parquet_in,
        stderr_has=(
            "scoring.custom_function.name='compute_score': compute_score(solution_str, ground_truth, "
            "method='strict', format_score=0.0, score=1.0) in {tmp}/gsm8k.py cannot be called as verl calls a "
            "reward function, compute_score(data_source=, solution_str=, ground_truth=, extra_info=)",
        ),
        stdout_lacks=(BUILT,),
        builds_models=False,
    ),
]


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.name, marks=[pytest.mark.distributed] if c.builds_models else []) for c in CASES],
)
def test_cli_case(case: CliCase, tmp_path: Path) -> None:
    def here(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path))

    for name, contents in case.files.items():
        (tmp_path / name).write_text(contents)
    if case.prepare is not None:
        case.prepare(tmp_path)
    args = tuple(map(here, case.args))
    if case.builds_models or case.nproc > 1:
        proc = run_cli(*args, nproc=case.nproc, exit_code=case.exit_code)
    else:
        proc = run_cli_here(*args, exit_code=case.exit_code)
    for text in map(here, case.stdout_has):
        assert text in proc.stdout, (text, proc.stdout[-3000:])
    for text in map(here, case.stderr_has):
        assert text in proc.stderr, (text, proc.stderr[-3000:])
    for text in map(here, case.stderr_once):
        assert proc.stderr.count(text) == 1, (text, proc.stderr[-3000:])
    for text in map(here, case.stdout_lacks):
        assert text not in proc.stdout, (text, proc.stdout[-3000:])
    for path in case.absent:
        assert not (tmp_path / path).exists(), path
    if case.exit_code != 0 and not case.quotes_a_traceback:  # a user's error is named, not a traceback
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if case.check is not None:
        case.check(tmp_path, proc)


@pytest.mark.distributed
def test_smoke_run_per_model_layouts_under_torchrun(tmp_path: Path) -> None:
    proc = run_cli(
        "smoke",
        f"output_dir={tmp_path}",
        "actor.tp=2",
        "actor.pp=2",
        "critic.pp=2",
        "reference.tp=2",
        "reward.tp=1",
        nproc=4,
    )
    for layout in ("TP2xPP2xDP1", "TP1xPP2xDP2", "TP2xPP1xDP2", "TP1xPP1xDP4"):
        assert layout in proc.stdout
    single = run_cli("smoke", f"output_dir={tmp_path / 'single'}")
    assert f"torch {torch.__version__}, CUDA " in single.stdout  # the versions line a health check shows
    multi = json.loads((tmp_path / "smoke.json").read_text())
    ref = json.loads((tmp_path / "single" / "smoke.json").read_text())
    assert set(ref) == {"actor", "critic", "reference", "reward"}
    # actor and reference load the same built-in weights: same outputs.
    assert ref["actor"]["output_mean"] == ref["reference"]["output_mean"]
    for role in ("actor", "critic", "reference", "reward"):
        assert abs(multi[role]["output_mean"] - ref[role]["output_mean"]) < 1e-5
        assert abs(multi[role]["output_std"] - ref[role]["output_std"]) < 1e-5


@pytest.mark.distributed
def test_a_critic_started_from_the_actor_converts_to_hf(tmp_path: Path) -> None:
    """critic.path empty starts the critic from the actor's model, and config.yaml keeps it empty:
    converting its checkpoint failed ("neither critic.path nor model.path is set"), so a trained
    critic could not be exported at all. The actor's path is its base now."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "run"
    run_cli(
        "ppo", "--config", "ppo-tiny", "algorithm.advantage_estimator=gae", "critic.path=''",
        f"output_dir={out}", "max_steps=1", "save_hf=false",
    )  # fmt: skip
    critic = out / "checkpoints" / "step_1" / "models" / "critic"
    run_cli("convert", "mcore-to-hf", str(critic), str(tmp_path / "critic_hf"))
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic_hf")
    assert model.config.num_labels == 1 and (tmp_path / "critic_hf" / "tokenizer_config.json").is_file()
    weights = {k: v for f in (tmp_path / "critic_hf").glob("*.safetensors") for k, v in load_file(f).items()}
    assert torch.equal(model.score.weight.detach(), weights["score.weight"])


@pytest.mark.distributed
def test_convert_round_trip_loads_in_transformers(tmp_path: Path) -> None:
    original = make_tiny_hf_model("qwen3", False, tmp_path / "hf")
    run_cli("convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "tp=2", "pp=2", nproc=4)
    run_cli("convert", "direction=mcore-to-hf", f"source={tmp_path / 'ckpt'}", f"output={tmp_path / 'out'}")
    _, lm_cls, _ = hf_classes("qwen3")
    reloaded = lm_cls.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    ids = torch.randint(0, PAD_ID, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, original(ids).logits)


@pytest.mark.distributed
def test_generate_command_same_tokens_at_tp1_and_tp2(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello world"}\n{"prompt_ids": [5, 6, 7, 8]}\n{"prompt": "abc"}\n')
    settings = [
        "model=builtin:tiny-llama",
        f"input={prompts}",
        "rollout.sampling.max_new_tokens=6",
        "rollout.sampling.temperature=0",
        "rollout.sampling.ignore_eos=true",
        "rollout.engine.max_batch_size=2",
    ]
    run_cli("generate", *settings, f"output={tmp_path / 'tp1.jsonl'}")
    # The same run in the flags that are aliases of those keys.
    flags = ["--model", "builtin:tiny-llama", "--input", str(prompts), "--max-new-tokens", "6", "--temperature", "0"]
    flags += ["--ignore-eos", "--max-batch-size", "2", "--tp", "2", "--output", str(tmp_path / "tp2.jsonl")]
    run_cli("generate", *flags, nproc=2)
    rows1 = [json.loads(line) for line in (tmp_path / "tp1.jsonl").read_text().splitlines()]
    rows2 = [json.loads(line) for line in (tmp_path / "tp2.jsonl").read_text().splitlines()]
    assert [r["prompt_index"] for r in rows1] == [0, 1, 2]
    assert [r["token_ids"] for r in rows1] == [r["token_ids"] for r in rows2]
    assert all(len(r["token_ids"]) == 6 and r["finish_reason"] == "length" for r in rows1)
    for a, b in zip(rows1, rows2, strict=True):
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) < 1e-5


@pytest.mark.distributed
def test_generate_data_parallel_groups_sample_independently(tmp_path: Path) -> None:
    """Before: every group seeded its sampler alike, so the same prompt on two groups got the same
    completion (and different prompts correlated draws)."""
    prompts = tmp_path / "same.jsonl"
    prompts.write_text('{"prompt": "same prompt"}\n' * 4)
    run_cli(
        "generate", "model=builtin:tiny-llama", f"input={prompts}", f"output={tmp_path / 'o.jsonl'}",
        "rollout.sampling.max_new_tokens=8", "rollout.sampling.ignore_eos=true", nproc=2,
    )  # fmt: skip
    rows = [json.loads(line)["token_ids"] for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and len({tuple(r) for r in rows}) == 4, rows  # prompts 0, 2 on one group; 1, 3 on the other


def test_generate_reads_its_input_with_the_data_settings(tmp_path: Path) -> None:
    """Before: no data.* keys, so another prompt column, skipping bad rows or a chat template's
    variables (a run trained with enable_thinking=false) could not be set."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "Hello world"}\n{"prompt": "abc"}\n')
    (tmp_path / "q.jsonl").write_text('{"question": "Hello world"}\n{"question": ""}\n{"question": "abc"}\n')
    common = ["model=builtin:tiny-llama", "rollout.sampling.max_new_tokens=4", "rollout.sampling.temperature=0"]
    run_cli_here("generate", *common, f"input={tmp_path / 'p.jsonl'}", f"output={tmp_path / 'p_out.jsonl'}")
    proc = run_cli_here(
        "generate", *common, f"input={tmp_path / 'q.jsonl'}", f"output={tmp_path / 'q_out.jsonl'}",
        "data.prompt_key=question", "data.on_invalid=skip",
    )  # fmt: skip
    assert "skipped 1: empty 1" in proc.stdout, proc.stdout
    rows = [
        [json.loads(line) for line in (tmp_path / f).read_text().splitlines()] for f in ("p_out.jsonl", "q_out.jsonl")
    ]
    assert [r["token_ids"] for r in rows[0]] == [r["token_ids"] for r in rows[1]]
    # The input's rows: before, the skipped row shifted every later prompt_index by one.
    assert [r["prompt_index"] for r in rows[0]] == [0, 1] and [r["prompt_index"] for r in rows[1]] == [0, 2]


def test_generate_text_leaves_out_a_stop_token_of_the_settings_and_parquet_holds_the_same_rows(tmp_path: Path) -> None:
    """Before: ``text`` dropped a final stop token only if it was the tokenizer's EOS, so one of
    rollout.sampling.stop_token_ids stayed in it (and in ppo's reward input); output=*.parquet was
    written as JSONL."""
    import pyarrow.parquet as pq

    (tmp_path / "p.jsonl").write_text('{"prompt": "Hello world"}\n')
    # Sampled (a greedy tiny model repeats one token): the same seed draws the same tokens each run.
    common = ["model=builtin:tiny-llama", f"input={tmp_path / 'p.jsonl'}", "rollout.sampling.ignore_eos=true"]
    run_cli_here("generate", *common, "rollout.sampling.max_new_tokens=8", f"output={tmp_path / 'free.parquet'}")
    (free,) = pq.read_table(tmp_path / "free.parquet").to_pylist()
    tokens = free["token_ids"]
    stop_at = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    run_cli_here("generate", *common, f"rollout.sampling.max_new_tokens={stop_at}", f"output={tmp_path / 'cut.jsonl'}")
    run_cli_here(
        "generate", *common, "rollout.sampling.max_new_tokens=8",
        f"rollout.sampling.stop_token_ids=[{tokens[stop_at]}]", f"output={tmp_path / 'stopped.jsonl'}",
    )  # fmt: skip
    (cut,) = [json.loads(line) for line in (tmp_path / "cut.jsonl").read_text().splitlines()]
    (stopped,) = [json.loads(line) for line in (tmp_path / "stopped.jsonl").read_text().splitlines()]
    assert stopped["token_ids"] == tokens[: stop_at + 1] and stopped["finish_reason"] == "stop"
    assert stopped["text"] == cut["text"] and cut["token_ids"] == tokens[:stop_at]
    assert set(free) == set(cut) and free["prompt"] == cut["prompt"] and free["logprobs"][:stop_at] == cut["logprobs"]


def test_generate_parquet_output_keeps_every_column_of_any_row(tmp_path: Path) -> None:
    """Before: pyarrow took the columns of the first row alone (a verl row's ground_truth, present
    in later rows only, was dropped), and values of two types failed the write after generation."""
    import pyarrow.parquet as pq

    from megatron_rlhf.trainer.generate import write_rows

    rows = [
        {"text": "a"},
        {"text": "b", "ground_truth": "7"},
        {"text": "c", "ground_truth": 7, "turns": [{"role": "x"}]},
    ]
    write_rows(tmp_path / "o.parquet", rows)
    assert pq.read_table(tmp_path / "o.parquet").to_pylist() == [
        {"text": "a", "ground_truth": None, "turns": None},
        {"text": "b", "ground_truth": '"7"', "turns": None},
        {"text": "c", "ground_truth": "7", "turns": [{"role": "x"}]},
    ]


def test_generate_names_the_input_row_of_a_prompt_too_long(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text(
        "".join(json.dumps({"prompt": text}) + "\n" for text in ("hi", "x" * 40, "y" * 50))
    )
    proc = run_cli_here(
        "generate", "model=builtin:tiny-llama", f"input={tmp_path / 'p.jsonl'}", f"output={tmp_path / 'o.jsonl'}",
        "rollout.engine.max_seq_len=32", exit_code=2,
    )  # fmt: skip
    assert (
        f"input={tmp_path / 'p.jsonl'}: 2 prompt(s) have more than rollout.engine.max_seq_len - 1 = 31 tokens, the "
        "first row 1 (0-based, as prompt_index counts) with 40: raise rollout.engine.max_seq_len, or set "
        "rollout.engine.on_long_prompt=truncate" in proc.stderr
    )
    assert not (tmp_path / "o.jsonl").exists()


def test_generate_stops_at_the_models_positions_and_says_so(tmp_path: Path) -> None:
    """Before: 512 new tokens after the prompt on a model of 32 positions, with no word."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(make_chat_tokenizer("qwen2", tmp_path / "hf")))
    make_tiny_hf_model("qwen2", False, tmp_path / "hf", vocab_size=vocab, pad_token_id=None, max_position_embeddings=32)
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [5, 6, 7, 8, 9]}\n')
    proc = run_cli_here(
        "generate", f"model={tmp_path / 'hf'}", f"input={tmp_path / 'p.jsonl'}", f"output={tmp_path / 'o.jsonl'}",
        "rollout.sampling.ignore_eos=true", "rollout.sampling.max_new_tokens=100",
    )  # fmt: skip
    assert "max_seq_len=2048 is past the model's max_position_embeddings=32" in proc.stdout
    (row,) = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert len(row["token_ids"]) == 32 - 5 and row["finish_reason"] == "length"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the advice is for a machine without a GPU")
def test_generate_on_cuda_without_a_gpu_advises_the_key_value_setting(tmp_path: Path) -> None:
    """The advice is in the syntax of the command that printed it (it was device=cpu to a --device user)."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    args = ("model=builtin:tiny-llama", f"input={tmp_path / 'p.jsonl'}", f"output={tmp_path / 'o.jsonl'}")
    for device in (("device=cuda",), ("--device", "cuda")):
        proc = run_cli_here("generate", *args, *device, exit_code=2)
        assert "device=cuda was requested but no CUDA device is visible; use device=cpu" in proc.stderr


def test_generates_multi_turn_trajectories_render_later_turns_with_the_template_variables(tmp_path: Path) -> None:
    """generate rendered the prompts with data.chat_template_kwargs but the environment's turns
    without them: with Qwen3's enable_thinking=false every later generation prompt lacked the empty
    think block, so the model was sampled in thinking mode from the second turn on (ppo passed them)."""
    from transformers import AutoTokenizer

    from tests.unit.test_data_chat_tools import QWEN3_STYLE_TEMPLATE

    model = make_chat_tokenizer("qwen2", tmp_path / "model")
    (model / "chat_template.jinja").write_text(QWEN3_STYLE_TEMPLATE, encoding="utf-8")
    vocab = len(AutoTokenizer.from_pretrained(model))
    make_tiny_hf_model("qwen2", False, model, vocab_size=vocab, pad_token_id=None)
    rows = [
        {"prompt": [{"role": "user", "content": "count to 1"}],
         "extra_info": {"interaction_kwargs": {"name": "retry", "question": "count to 1"}}},
    ]  # fmt: skip
    _write_jsonl(tmp_path / "p.jsonl", rows)
    (tmp_path / "interactions.yaml").write_text(
        "interaction:\n  - name: retry\n    class_name: tests.distributed.interaction_fixtures.RetryOnce\n"
    )
    stops = ",".join(str(i) for i in range(0, vocab, 4))  # a quarter of the vocabulary ends a turn
    run_cli_here(
        "generate", f"model={model}", f"input={tmp_path / 'p.jsonl'}", f"output={tmp_path / 'out.jsonl'}",
        "rollout.sampling.max_new_tokens=96", f"rollout.engine.eos_token_ids=[{stops}]",
        "rollout.multi_turn.enable=true", "data.chat_template_kwargs={enable_thinking: false}",
        f"rollout.multi_turn.interaction_config_path={tmp_path / 'interactions.yaml'}",
    )  # fmt: skip
    (row,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    user_turns = [turn["text"] for turn in row["turns"] if turn["role"] == "user"]
    assert user_turns and all(text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for text in user_turns)
