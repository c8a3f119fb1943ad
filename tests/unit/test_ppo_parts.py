"""Pieces of the PPO trainer: the rollout batch layout (hand-derived), reward-model scores against
HF transformers, rule scores through the trainer, and the up-front config checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rlhf.config.loader import ConfigError, load_config
from megatron_rlhf.rewards import resolve_rule
from megatron_rlhf.rewards.config import OverlongConfig, ScoringConfig, scoring_errors
from megatron_rlhf.rewards.scoring import Scorer
from megatron_rlhf.rollout.engine import Completion
from megatron_rlhf.trainer.ppo import rollout_batch
from megatron_rlhf.trainer.ppo_config import PPOConfig, check_ppo_config
from tests.helpers import VOCAB, hf_reference_outputs, make_tiny_hf_model


def _completion(prompt_index: int, prompt: list[int], response: list[int]) -> Completion:
    return Completion(
        prompt_index=prompt_index,
        sample_index=0,
        prompt_ids=prompt,
        token_ids=response,
        logprobs=[-1.0] * len(response),
    )


def test_rollout_batch_layout_hand_derived() -> None:
    completions = [_completion(0, [7, 8, 9], [10, 11]), _completion(1, [7], [12, 13, 14, 15])]
    batch = rollout_batch(completions, pad_id=0)
    assert batch["input_ids"].tolist() == [[7, 8, 9, 10, 11], [7, 12, 13, 14, 15]]
    assert batch["response_mask"].tolist() == [[False, False, False, True, True], [False, True, True, True, True]]
    assert batch["attention_mask"].all()
    assert batch["lengths"].tolist() == [5, 5]
    assert batch["prompt_index"].tolist() == [0, 1]
    short = rollout_batch([_completion(0, [7], [10]), _completion(0, [7, 8], [10, 11])], pad_id=3)
    assert short["input_ids"].tolist() == [[7, 10, 3, 3], [7, 8, 10, 11]]
    assert short["response_mask"].tolist() == [[False, True, False, False], [False, False, True, True]]
    assert short["attention_mask"].tolist() == [[True, True, False, False], [True, True, True, True]]


def test_scores_are_reward_model_last_token_plus_rules(world_of_one, tmp_path: Path) -> None:
    """The reward model's part equals HF transformers' score of each unpadded sequence at its last
    token; the rule's part is the rule applied to the decoded response of the right row."""
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role

    hf = make_tiny_hf_model("llama", True, tmp_path / "rm")
    role = build_role(
        "reward",
        ModelConfig(path=str(tmp_path / "rm")),
        architecture_of(str(tmp_path / "rm")),
        world_size=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, VOCAB - 1, (n,), generator=g).tolist()  # noqa: E731
    completions = [_completion(0, ids(5), ids(3)), _completion(0, ids(2), ids(9)), _completion(1, ids(7), ids(1))]
    scorer = Scorer(
        ScoringConfig(),
        {"count": resolve_rule("tests.unit.test_ppo_parts:_response_length")},
        None,
        role,
        stop_ids=(),
        max_new_tokens=16,
        max_tokens_per_micro_batch=24,
    )
    batch = rollout_batch(completions, pad_id=VOCAB - 1)
    scores = scorer.score(batch, completions, [{}, {}], lambda rows: ["x" * len(ids) for ids in rows])
    total, parts = scores.rewards, scores.metrics()
    expected_rm = torch.stack(
        [hf_reference_outputs(hf, torch.tensor([c.prompt_ids + c.token_ids]))[0, -1, 0] for c in completions]
    )
    lengths = torch.tensor([3.0, 9.0, 1.0])
    torch.testing.assert_close(total, expected_rm + lengths, rtol=1e-5, atol=1e-5)
    assert parts["reward/rule/count"] == pytest.approx(lengths.mean().item())
    assert parts["reward/reward_model"] == pytest.approx(expected_rm.mean().item(), abs=1e-5)


def _response_length(sample) -> float:
    return float(len(sample.response_text))


def _errors(world_size: int, *overrides: str) -> str:
    """The refusal of the overrides: by the loader (a setting outside its choices) or by the check."""
    with pytest.raises(ConfigError) as err:
        check_ppo_config(load_config("ppo-tiny", list(overrides), schema=PPOConfig), world_size)
    return str(err.value)


def test_the_preset_is_valid() -> None:
    checked = check_ppo_config(load_config("ppo-tiny", [], schema=PPOConfig), 1)
    assert sorted(checked.archs) == [
        "actor",
        "reference",
    ]  # GRPO with a KL loss and rule rewards: no critic, no reward model
    assert list(checked.rules) == ["lowercase_fraction"]
    archs = check_ppo_config(
        load_config(
            "ppo-tiny",
            ["algorithm.advantage_estimator=gae", "scoring.use_reward_model=true", "algorithm.loss.kl_loss_coef=0"],
            schema=PPOConfig,
        ),
        1,
    ).archs
    assert sorted(archs) == ["actor", "critic", "reward"]


@pytest.mark.parametrize(
    "world_size, overrides, message",
    [
        (1, ["rollout.sampling.n=1"], "rollout.sampling.n=1: the grpo estimator compares the samples of a prompt"),
        (1, ["rollout.sampling.temperature=0"], "rollout.sampling.temperature=0.0 must be > 0"),
        (1, ["algorithm.advantage_estimator=ppo"], "algorithm.advantage_estimator='ppo' must be one of"),
        (1, ["scoring.rules=[]"], "nothing scores the responses"),
        (1, ["scoring.rules=[lowercase]"], "Did you mean 'lowercase_fraction'"),
        (
            1,
            ["mini_batch_size=12"],
            "mini_batch_size=12 must divide the rollout's prompts_per_step x rollout.sampling.n = 32",
        ),
        (
            2,
            ["actor.tp=2", "prompts_per_step=3", "rollout.sampling.n=3", "mini_batch_size=9"],
            "the rollout's 9 sequences (prompts_per_step x rollout.sampling.n) must split evenly over the "
            "reference's dp=2",
        ),
        (2, ["rollout.tp=3"], "rollout.tp=3 must divide num_attention_heads=4"),
        (
            1,
            ["data.max_prompt_length=1000", "rollout.sampling.max_new_tokens=100"],
            "data.max_prompt_length + rollout.sampling.max_new_tokens = 1100 exceeds the actor's "
            "max_position_embeddings=1024",
        ),
        (1, ["actor.path=builtin:tiny-llama-rm"], "the actor needs a *ForCausalLM model"),
        (
            1,
            ["scoring.use_reward_model=true", "reward.path=builtin:tiny-llama"],
            "reward.path='builtin:tiny-llama' is a LlamaForCausalLM; the reward needs a *ForSequenceClassification",
        ),
        (
            1,
            ["eval.judged_by=reward_model"],
            "eval.judged_by='reward_model' is not a scoring part; the parts are ['lowercase_fraction']",
        ),
        (1, ["data.train=[]"], "data.train is empty"),
        (1, ["algorithm.loss.agg_mode=mean"], "algorithm.loss.agg_mode='mean' must be one of"),
        (1, ["warmup=sometimes"], "warmup='sometimes' must be one of ['auto', 'always', 'never']"),
        (1, ["reference.update=sometimes"], "reference.update='sometimes' must be one of ['none', 'periodic', 'ema']"),
        (1, ["reference.update=periodic", "reference.update_every=0"], "reference.update_every=0 must be >= 1"),
        (1, ["reference.update=ema", "reference.ema_decay=1"], "reference.ema_decay=1.0 must be in [0, 1)"),
        (
            1,
            ["reference.update=ema", "algorithm.loss.kl_loss_coef=0"],
            "reference.update='ema' refreshes a reference that nothing uses: set algorithm.kl_penalty.coef > 0 or",
        ),
        (
            1,
            ["reference.update=periodic", "reference.path=builtin:llama-1.5b"],
            (
                "reference.path='builtin:llama-1.5b' is not the architecture of actor.path='builtin:tiny-llama' "
                "(vocab_size 151936 vs 512, hidden_size 1536 vs 128"
            ),
        ),
    ],
)
def test_bad_configs_are_named_up_front(world_size: int, overrides: list[str], message: str) -> None:
    assert message in _errors(world_size, *overrides)


def test_every_problem_is_listed_at_once() -> None:
    text = _errors(1, "rollout.sampling.temperature=0", "scoring.rules=[]", "ppo_epochs=0")
    assert "rollout.sampling.temperature" in text and "nothing scores" in text and "ppo_epochs=0 must be >= 1" in text


def _stub_completion(prompt_index: int, length: int, finish_reason: str = "length") -> Completion:
    return Completion(
        prompt_index=prompt_index,
        sample_index=0,
        prompt_ids=[5],
        token_ids=[7] * length,
        logprobs=[0.0] * length,
        finish_reason=finish_reason,
    )


def test_weighted_parts_and_the_overlong_penalty_hand_derived(world_of_one) -> None:
    """score = 0.7 x custom + 0.3 x rule; DAPO's over-long penalty ramps from 0 at
    max_new_tokens - buffer = 6 to -penalty = -0.5 at max_new_tokens = 10."""
    cfg = ScoringConfig(
        use_reward_model=False,
        rules=["tests.unit.test_ppo_parts:_response_length"],
        weights={"tests.unit.test_ppo_parts:_response_length": 0.3, "custom_function": 0.7},
        overlong=OverlongConfig(buffer=4, penalty=0.5),
    )
    rules = {name: resolve_rule(name) for name in cfg.rules}
    custom = _inline_function(lambda **kw: {"score": float(kw["ground_truth"]), "hits": 1.0})
    completions = [_stub_completion(0, 3), _stub_completion(1, 8), _stub_completion(1, 10)]
    extras = [
        {"data_source": "s", "ground_truth": 2, "extra_info": {}},
        {"data_source": "s", "ground_truth": -1, "extra_info": {}},
    ]
    scorer = Scorer(cfg, rules, custom, None, stop_ids=(), max_new_tokens=10, max_tokens_per_micro_batch=64)
    scores = scorer.score(
        rollout_batch(completions, pad_id=0), completions, extras, lambda rows: ["x" * len(ids) for ids in rows]
    )
    raw, reward, metrics = scores.raw, scores.rewards, scores.metrics()
    expected_raw = torch.tensor([0.3 * 3 + 0.7 * 2, 0.3 * 8 + 0.7 * -1, 0.3 * 10 + 0.7 * -1])
    torch.testing.assert_close(raw, expected_raw)
    torch.testing.assert_close(reward - raw, torch.tensor([0.0, -0.5 * 2 / 4, -0.5]))
    assert metrics["reward/custom/hits"] == 1.0 and metrics["reward/overlong_penalty"] == pytest.approx(-0.25)


def test_rule_text_has_no_trailing_eos(world_of_one) -> None:
    """A stopped response's text ends before its EOS (verl decodes with special tokens skipped)."""
    scorer = Scorer(
        ScoringConfig(use_reward_model=False),
        {},
        None,
        None,
        stop_ids=(2,),
        max_new_tokens=8,
        max_tokens_per_micro_batch=64,
    )
    stopped = Completion(
        prompt_index=0, sample_index=0, prompt_ids=[5], token_ids=[9, 9, 2], logprobs=[0.0] * 3, finish_reason="stop"
    )
    other_prompt = Completion(prompt_index=1, sample_index=0, prompt_ids=[6, 4], token_ids=[8], logprobs=[0.0])
    decoded_ids = []

    def decode_batch(rows: list[list[int]]) -> list[str]:
        decoded_ids.extend(rows)
        return [",".join(map(str, ids)) for ids in rows]

    decoded = scorer.samples([stopped, other_prompt, _stub_completion(0, 2)], decode_batch)
    assert sorted(decoded_ids) == [[5], [6, 4], [7, 7], [8], [9, 9]]  # each prompt once
    assert [s.response_text for s in decoded] == ["9,9", "8", "7,7"]
    assert [s.prompt_text for s in decoded] == ["5", "6,4", "5"] and decoded[0].extras == {}
    with_extras = scorer.samples([other_prompt, stopped], decode_batch, extras=[{"answer": 0}, {"answer": 1}])
    assert [s.extras for s in with_extras] == [{"answer": 1}, {"answer": 0}]


def test_rules_score_on_a_thread_while_the_caller_goes_on(world_of_one) -> None:
    """``Scorer.start`` returns before its rules have run: a rule that waits for the caller to go
    on (an event set after ``start`` returned) finishes; ``result()`` equals ``score``, and what a
    rule raises is raised there."""
    import threading

    went_on = threading.Event()
    seen: list[bool] = []

    def waits_for_the_caller(sample) -> float:
        seen.append(went_on.wait(timeout=30))
        return float(len(sample.response_ids))

    completions = [_stub_completion(0, 3), _stub_completion(1, 5)]
    batch = rollout_batch(completions, pad_id=0)
    scorer = Scorer(
        ScoringConfig(use_reward_model=False),
        {"waits": waits_for_the_caller},
        None,
        None,
        stop_ids=(),
        max_new_tokens=8,
        max_tokens_per_micro_batch=64,
    )
    decode = lambda rows: ["x" * len(ids) for ids in rows]  # noqa: E731
    pending = scorer.start(batch, completions, [{}, {}], decode)
    went_on.set()
    scores = pending.result()
    assert seen == [True, True]
    torch.testing.assert_close(scores.raw, torch.tensor([3.0, 5.0]))
    torch.testing.assert_close(scores.raw, scorer.score(batch, completions, [{}, {}], decode).raw)

    def fails(sample) -> float:
        raise RuntimeError("rule failed")

    failing = Scorer(
        ScoringConfig(use_reward_model=False),
        {"fails": fails},
        None,
        None,
        stop_ids=(),
        max_new_tokens=8,
        max_tokens_per_micro_batch=64,
    )
    pending = failing.start(batch, completions, [{}, {}], decode)
    with pytest.raises(RuntimeError, match="rule failed"):
        pending.result()


def test_scoring_config_errors_name_the_part() -> None:
    errors, _, _ = scoring_errors(
        ScoringConfig(use_reward_model=False, rules=["lowercase_fraction"], weights={"reward_model": 1.0})
    )
    assert errors == ["scoring.weights.reward_model: no such part; the parts are ['lowercase_fraction']"]
    rules = ["lowercase_fraction", "exact_answer"]
    errors, _, _ = scoring_errors(ScoringConfig(rules=rules, weights={"lowercase_fraction": 0, "exact_answer": 0.0}))
    assert errors == [
        "scoring.weights={'lowercase_fraction': 0, 'exact_answer': 0.0} gives every part (lowercase_fraction, "
        "exact_answer) weight 0: every reward would be 0 and the policy would learn nothing; a part not named has "
        "weight 1"
    ]
    assert scoring_errors(ScoringConfig(rules=rules, weights={"lowercase_fraction": 0}))[0] == []


def _inline_function(function):
    from megatron_rlhf.rewards.custom import CustomRewardFunction

    return CustomRewardFunction(function, "compute_score", Path("inline.py"))


def test_a_reference_that_follows_the_actor_must_take_its_padded_vocabulary(tmp_path: Path) -> None:
    """Vocab 97 pads to 128 at the actor's TP1; a TP3 reference cannot split 128 rows evenly."""
    make_tiny_hf_model(
        "llama",
        False,
        tmp_path / "m",
        num_attention_heads=6,
        num_key_value_heads=3,
        hidden_size=48,
        max_position_embeddings=256,
    )
    paths = [
        f"actor.path={tmp_path / 'm'}",
        f"reference.path={tmp_path / 'm'}",
        "reference.tp=3",
        "prompts_per_step=3",
        "mini_batch_size=12",
    ]
    check_ppo_config(load_config("ppo-tiny", paths, schema=PPOConfig), 3)  # a fixed reference may pad as it likes
    assert "reference.tp=3 must divide the source model's padded vocabulary 128 (vocab 97)" in _errors(
        3, *paths, "reference.update=ema"
    )


def test_reference_settings_check_themselves_when_built_in_code() -> None:
    from megatron_rlhf.hybrid.config import ReferenceConfig

    with pytest.raises(ValueError, match=r"^update_every=0 must be >= 1; ema_decay=-0.5 must be in \[0, 1\)"):
        ReferenceConfig(update="periodic", update_every=0, ema_decay=-0.5)


def test_a_generation_tp_error_names_only_rollout_tp() -> None:
    """Generation has no pipeline setting: the world-size rule names rollout.tp alone (no rollout.pp)."""
    text = _errors(2, "rollout.tp=3")
    assert "rollout.tp=3 must divide the world size 2" in text and "rollout.pp" not in text


def test_validation_rows_without_a_data_source_beside_rows_with_one_are_unknown() -> None:
    """Before: their figures were logged as '/greedy_accuracy'."""
    from megatron_rlhf.trainer.ppo import source_prefixes

    assert source_prefixes([{"data_source": "GSM 8k"}, {}, {"data_source": None}]) == ["gsm_8k", "unknown", "unknown"]
    assert source_prefixes([{}, {"ground_truth": 1}]) == ["", ""]  # no row has one: no per-source figures
