"""Rollout (generation) engine: token sampling, and later the KV-cached generation loop."""
