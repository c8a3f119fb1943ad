"""megatron-rlhf: a Megatron-native RLHF training stack (PPO/GRPO), launched with torchrun."""

__version__ = "0.1.0"
