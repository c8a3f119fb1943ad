"""Model weights in and out: HF safetensors and megatron (dist_checkpointing) formats, where a
configured model comes from (``sources.py``: HF dir, megatron checkpoint or ``builtin:NAME``, built in
its layout), resumable training state, the final HF export and the ``convert`` command."""
