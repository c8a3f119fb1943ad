"""Data for the SFT, reward-model and RL trainers: tokenizers, dataset files, batches, sampling."""

from .batch import pack_batch
from .chat_template import ChatTemplate, ChatTemplateError
from .datasets import (
    RAW_PROMPT,
    DataReport,
    OnProblem,
    PreferenceDataset,
    PreferenceExample,
    PromptDataset,
    PromptExample,
    SFTDataset,
    SFTExample,
    SkippedRow,
    load_preference_dataset,
    load_prompt_dataset,
    load_sft_dataset,
)
from .records import DataError, Record, data_files, read_records
from .sampler import epoch_batches, num_steps
from .tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "RAW_PROMPT",
    "ByteTokenizer",
    "ChatTemplate",
    "ChatTemplateError",
    "DataError",
    "DataReport",
    "HFTokenizer",
    "OnProblem",
    "PreferenceDataset",
    "PreferenceExample",
    "PromptDataset",
    "PromptExample",
    "Record",
    "SFTDataset",
    "SFTExample",
    "SentencePieceTokenizer",
    "SkippedRow",
    "Tokenizer",
    "data_files",
    "epoch_batches",
    "load_preference_dataset",
    "load_prompt_dataset",
    "load_sft_dataset",
    "load_tokenizer",
    "num_steps",
    "pack_batch",
    "read_records",
]
