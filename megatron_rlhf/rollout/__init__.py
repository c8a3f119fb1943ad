"""Generation: the engine interface (``engine.py``), the native engine (KV cache, continuous
batching, CUDA-graph decode; ``native.py``), token sampling with trainer-exact log-probs
(``sampling.py``) and the ``generate`` command."""
