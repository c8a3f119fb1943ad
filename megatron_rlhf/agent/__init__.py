"""Multi-turn rollouts' environment: tool-call parsers, tools (verl's BaseTool shape, built-ins, the
tools file), their execution on host threads, and ``ToolAgent``, the engine's ``Agent``.

Nothing is imported here, so that reading ``rollout.multi_turn`` (``agent/config.py``) loads no more
than it needs."""
