"""An interaction for the CLI tests (imported by its dotted path from an interactions file): it checks
that the conversation starts with the prompt's question, asks for another try once, scoring the first
answer 0, then ends the trajectory, scoring the second 0.5."""

from __future__ import annotations

from typing import Any

from megatron_rlhf.agent.interactions import BaseInteraction


class RetryOnce(BaseInteraction):
    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any):
        assert kwargs["name"] == "retry" and "question" in kwargs, kwargs
        # the whole conversation, as verl hands it: the prompt's message first, then the trajectory's
        assert messages[0]["role"] == "user" and messages[0]["content"].lower().rstrip(".") == kwargs["question"]
        if sum(m["role"] == "assistant" for m in messages) == 1:
            return False, f"Try again: {kwargs['question']}", 0.0, {}
        return True, "Done.", 0.5, {}
