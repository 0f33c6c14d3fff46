"""``answer_checker``: tells the model whether its last answer is right, and lets it try again when it is not.

Ground truth: ``extra_info.interaction_kwargs.ground_truth``. The answer is the last assistant message with tool
calls removed; it is right when it equals the ground truth (stripped) or, with ``match: contains``, contains it.
Right -> terminate with reward 1; wrong -> "Your answer is wrong. Try again." with reward 0, until
``max_attempts`` answers were checked (then terminate).
"""

from __future__ import annotations

import re
from typing import Any

from scaletrain.agent.interactions.base import BaseInteraction, register_interaction

TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


@register_interaction("answer_checker")
class AnswerCheckerInteraction(BaseInteraction):
    async def generate_response(self, instance_id: str, messages: list[dict], **kwargs: Any):
        state = self._instances.setdefault(instance_id, {})
        state["attempts"] = state.get("attempts", 0) + 1
        truth = str(state.get("ground_truth", "")).strip()
        answer = ""
        for message in reversed(messages):
            if message.get("role") == "assistant":
                answer = TOOL_CALL.sub("", message.get("content") or "").strip()
                break
        right = answer == truth if self.config.get("match", "exact") == "exact" else (truth and truth in answer)
        if right:
            return True, "Correct.", 1.0, {"correct": 1.0}
        done = state["attempts"] >= int(self.config.get("max_attempts", 3))
        return done, "Your answer is wrong. Try again.", 0.0, {"correct": 0.0}
