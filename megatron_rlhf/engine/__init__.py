"""Training/inference engine pieces shared by the trainer and the rollout engine."""
