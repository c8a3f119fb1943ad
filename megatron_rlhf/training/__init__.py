"""Training engine: log-probs from vocab-parallel logits, micro-batching, pipeline-schedule passes,
DDP + optimizer state, and the loss and output functions the trainers and rollouts share."""
