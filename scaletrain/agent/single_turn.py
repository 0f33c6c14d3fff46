"""``single_turn_agent``: one generation from the prompt, no tools (the agent-path twin of the sync rollout); a row
with images (``multi_modal_inputs``: the dataset's) is generated from them and carries them on."""

from __future__ import annotations

from typing import Any

from scaletrain.agent.base import AgentLoopBase, AgentLoopOutput, register_agent_loop


@register_agent_loop("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    def max_new_tokens(self, row: dict[str, Any]) -> int:
        """The response's token budget (a subclass may draw one per trajectory)."""
        return self.response_length

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        prompt_ids = list(row.get("raw_prompt_ids") or self.apply_chat_template(list(row["raw_prompt"])))
        self.check_prompt(prompt_ids, row)
        request_id = row["request_id"]
        limit = self.max_new_tokens(row)
        vision = row.get("multi_modal_inputs") or None
        params = {**sampling_params, "max_new_tokens": limit}
        out = await self.generate(request_id, prompt_ids, params, vision)
        ids = list(out.token_ids)[:limit]
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=ids,
            response_mask=[1] * len(ids),
            response_logprobs=list(out.log_probs)[: len(ids)],
            num_turns=2,
            metrics={"assistant_turns": 1.0},
            multi_modal_inputs=vision,
        )
