"""Model definitions: HF config parsing (``architecture.py``), HF <-> megatron weight-name maps
(``hf_weights.py``), the megatron-core model builder and layer spec, SDPA and KV-cache attention,
the value head, built-in random models, what one built model of a role bundles (``roles.py``), and
the speed-of-light figures of a model's work on a device (``roofline.py``, for the benchmarks).

File formats live in ``checkpoint/``; this folder knows shapes and names, not files."""
