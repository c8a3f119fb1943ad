"""Rank-aware logging, phase timers, memory figures (``log.py``) and the metric sinks every trainer
writes to: ``metrics.jsonl``, TensorBoard and other JSONL row files (``sinks.py``)."""
