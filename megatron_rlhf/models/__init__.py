"""Model definitions: HF config parsing (``architecture.py``), HF <-> megatron weight-name maps
(``hf_weights.py``), the megatron-core model builder and layer spec, SDPA and KV-cache attention,
the value head, built-in random models and what one built model of a role bundles (``roles.py``).
The speed-of-light figures the benchmarks compare against live with them (``scripts/bench/roofline.py``).

File formats live in ``checkpoint/``; this folder knows shapes and names, not files."""
