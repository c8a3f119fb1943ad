"""Trainers on the shared engine: ``sft`` (supervised fine-tuning) and ``rm`` (reward model).

Import the submodules (``megatron_rlhf.trainer.sft``, ``megatron_rlhf.trainer.rm``) directly;
this package imports nothing so that ``megatron-rlhf --help`` stays fast.
"""
