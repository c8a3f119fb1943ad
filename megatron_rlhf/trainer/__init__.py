"""The trainers: one loop (``loop.py``) for every command; ``ppo`` (RL; its step top to bottom in
``ppo.py``, its settings in ``ppo_config.py``), and ``sft`` and ``rm`` on their shared supervised
set-up (``supervised.py``).

Import the submodules directly; this package imports nothing so that ``megatron-rlhf --help`` stays
fast."""
