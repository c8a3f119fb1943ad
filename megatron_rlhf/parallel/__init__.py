"""Process start-up (torchrun environment, nccl/gloo, seeds), per-model parallel layouts through
megatron-core explicit process groups, the rules a layout must satisfy, and CPU (gloo) mode."""
