"""Shared test helpers: tiny random HF models and chat tokenizers made with transformers."""

from __future__ import annotations

import glob
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
VOCAB = 97  # prime: never a multiple of the padding step, so padding is always exercised
PAD_ID = VOCAB - 1  # inputs never contain it, so HF pools sequence scores at the last position

# Each family exercises the feature it is known for.
FAMILY_OVERRIDES = {
    "llama": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        max_position_embeddings=64,
        rope_theta=500000.0,
    ),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=24),  # head_dim != hidden/heads
    "mistral": dict(sliding_window=6),  # shorter than the test sequences
}


def hf_classes(family: str):
    import transformers

    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
    return (
        getattr(transformers, prefix + "Config"),
        getattr(transformers, prefix + "ForCausalLM"),
        getattr(transformers, prefix + "ForSequenceClassification"),
    )


def make_tiny_hf_model(family: str, score_head: bool, out_dir: str | Path, *, seed: int = 0, **overrides):
    """Save a tiny random HF model (fp32) made with transformers, and return it (eval mode)."""
    config_cls, lm_cls, cls_cls = hf_classes(family)
    sharded = overrides.pop("sharded", False)
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=PAD_ID,
        num_labels=1,
        attn_implementation="eager",
    )
    kwargs.update(FAMILY_OVERRIDES[family])
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = (cls_cls if score_head else lm_cls)(config).eval()
    with torch.no_grad():  # larger than HF's init so that layout bugs show up in the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    save_kwargs = dict(max_shard_size="40KB") if sharded else {}
    model.save_pretrained(out_dir, **save_kwargs)
    return model


# Chat templates of two common shapes, written here. The Qwen2-style one has plain {% %} tags on
# their own, indented lines: only trim_blocks + lstrip_blocks render it right. Assistant turns sit
# in a {% generation %} block, as in training templates.
QWEN2_TEMPLATE = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}

    {% else %}
{{ message['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

# Uses bos_token, strftime_now, raise_exception, tojson (for non-text content), the trim filter, a
# loop control, and a key that is present only when not null.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception("Unknown role '" + message['role'] + "': expected system, user or assistant") }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if loop.first and message['role'] == 'system' %}
        {{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}
    {%- endif %}
    {%- if message['name'] is defined %}
        {{- '(' + message['name'] + ') ' }}
    {%- endif %}
    {%- if message['content'] is string %}
        {{- message['content'] | trim }}
    {%- else %}
        {{- message['content'] | tojson }}
    {%- endif %}
    {{- '<|eot_id|>' }}
    {%- if message['role'] == 'assistant' and message['content'] == 'STOP' %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

# Written here in the shape of Qwen2.5-Instruct's template: tools in the system turn, consecutive tool
# messages in one user turn, each in <tool_response></tool_response>.
QWEN25_TOOLS_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content }}
    {%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\n\n# Tools\n\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nReturn each function call within <tool_call></tool_call> XML tags.<|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or message.role == 'assistant' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

# style -> (special tokens, template, named special tokens)
CHAT_STYLES = {
    "qwen2": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        QWEN2_TEMPLATE,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    ),
    "qwen25_tools": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        QWEN25_TOOLS_TEMPLATE,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    ),
    "llama3": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        LLAMA3_TEMPLATE,
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    ),
}


def make_chat_tokenizer(style: str, out_dir: str | Path) -> Path:
    """A byte-level BPE tokenizer with the special tokens and a chat template of the given style (qwen2,
    qwen25_tools or llama3), saved by transformers (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, template, tokens = CHAT_STYLES[style]
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    corpus = [
        "You are a helpful assistant.",
        "What is two plus three? It is five.",
        "system user assistant",
        "Bonjour, très bien merci",
        "Cutting Knowledge Date: December 2023",
        "Today Date",
    ]
    raw.train_from_iterator(
        corpus * 10,
        trainer=trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=raw, chat_template=template, **tokens).save_pretrained(str(out_dir))
    return Path(out_dir)


def policy_turn(tokenizer, text: str) -> list[int]:
    """A policy turn of a ``qwen25_tools`` conversation as the engine hands it to an episode: its ids,
    ending with the stop token."""
    return tokenizer.encode(text + "<|im_end|>")


def hf_reference_outputs(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token logits (causal LM) or per-token scores (sequence classifier)."""
    with torch.no_grad():
        if hasattr(model, "score"):
            hidden = model.model(input_ids).last_hidden_state
            return model.score(hidden)
        return model(input_ids).logits


def load_all_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(str(Path(model_dir) / "*.safetensors"))):
        tensors.update(load_file(path))
    return tensors


PPO_TINY_ROLLOUT = (
    "prompts_per_step=4",
    "rollout.sampling.n=4",
    "mini_batch_size=0",
    "rollout.sampling.max_new_tokens=8",
    "samples_per_step=0",
    "max_tokens_per_micro_batch=64",
    "data.max_prompt_length=56",
)
"""ppo-tiny cut to 16 sequences of at most 8 new tokens a step, one optimizer step per rollout over
micro-batches of 64 tokens (prompts of at most 56 tokens, so that the longest sequence fits one):
a few seconds a step on a CPU."""


def response_logprobs(role, batch: dict[str, torch.Tensor], max_tokens_per_micro_batch: int) -> torch.Tensor:
    """The trainer's per-token log-probs of ``role`` on a rollout batch (``trainer/ppo.py``'s
    ``rollout_batch``), the LM head only at the response's positions: what the engine's sampling
    log-probs are held to."""
    from megatron_rlhf.training.objectives import logprobs_output
    from megatron_rlhf.training.schedule import logits_only_at
    from megatron_rlhf.training.train import forward_all_rows

    response_only = logits_only_at(batch, "response_mask")
    return forward_all_rows(
        role, response_only, logprobs_output(role), max_tokens_per_micro_batch=max_tokens_per_micro_batch
    )
