"""``tool_agent``: a multi-turn loop that lets the model call tools and talk to a simulated user (interaction).

States: PENDING (render the prompt with the tool schemas) -> GENERATING (one assistant turn) -> PROCESSING_TOOLS
(parsed tool calls run concurrently, their answers appended) or INTERACTING (the interaction replies) -> back to
GENERATING, until TERMINATED: the response budget (``response_length`` tokens) is spent, a turn limit
(``max_assistant_turns`` / ``max_user_turns``; tool answers count as user turns) is reached, the model stopped
without a tool call and there is no interaction (or it ended the conversation), or a turn ended without EOS.

Token exactness: the ids the model generated are appended as generated (never decoded and re-encoded); tool and
user turns are appended as chat-template-rendered ids with mask 0 and log-prob 0. Tool calls beyond
``max_parallel_calls`` are dropped (counted); tool answers longer than ``max_tool_response_length`` characters
are truncated (``left`` keeps the start, ``right`` the end, ``middle`` both ends). A tool that raises, times out
(``tool_timeout_s``) or is unknown answers the model with an error text (counted in ``tool_errors``); the tool's
``release`` always runs, bounded by the tool's ``config.release_timeout_s`` (a timeout or failure is logged and
counted in ``tool_release_timeouts`` / ``tool_release_errors``). A ``create`` that outlasts the tool's
``config.create_timeout_s`` answers with an error text, counts ``tool_create_timeouts`` (and ``tool_errors``) and
ends the trajectory after that tool turn. Per-row inputs: ``raw_prompt`` (messages), ``extra_info.tool_selection``
(names of the tools this row may use; all when absent), ``extra_info.tools_kwargs``
({tool: {"create_kwargs": {...}}}), ``extra_info.interaction_kwargs`` ({"name": ..., **kwargs for
start_interaction}).

Images (a vision-language model: ``processor`` set): the row's prompt images (``multi_modal_data``) are rendered
with the prompt; a tool may answer with images (``ToolResponse.image``: one or a list of PIL images, ``{"bytes": ...}``
or paths), shown to the model as image items before the tool's text and rendered by the processor (its vision tokens
expanded, mask 0); every image of the trajectory goes to the server with the ids and out with the trajectory
(``multi_modal_inputs``). A tool image that cannot be decoded answers the model with an error text (counted in
``tool_errors``); a text model's loop drops tool images, counted in ``tool_images_dropped``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from backends.vision import gather_vision_inputs
from scaletrain.agent.base import AgentData, AgentLoopBase, AgentLoopOutput, AgentState, register_agent_loop
from scaletrain.agent.tool_parser import FunctionCall, ToolParser
from scaletrain.agent.tools.base import (
    BaseTool,
    ToolLifecycleTimeout,
    ToolResponse,
    create_with_timeout,
    release_with_timeout,
)
from scaletrain.utils.seeding import derive_seed

logger = logging.getLogger(__name__)
TRUNCATE_SIDES = ("left", "right", "middle")


def truncate_text(text: str, limit: int, side: str) -> str:
    """``text`` cut to ``limit`` characters (plus a marker): ``left`` keeps the start, ``right`` the end,
    ``middle`` the start and the end."""
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"tool_response_truncate_side must be one of {TRUNCATE_SIDES}, got {side!r}")
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[len(text) - limit :]
    head = limit // 2
    return text[:head] + "...(truncated)..." + text[len(text) - (limit - head) :]


@register_agent_loop("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    def __init__(
        self,
        config,
        server_manager,
        tokenizer,
        *,
        response_length: int,
        tools: dict[str, BaseTool] | None = None,
        interactions: dict | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, server_manager, tokenizer, response_length=response_length, **kwargs)
        self.tools = dict(tools or {})
        self.interactions = dict(interactions or {})
        self.parser = ToolParser.get_tool_parser(config.format, tokenizer)
        truncate_text("", 0, config.tool_response_truncate_side)  # fail early on a bad side

    # ------------------------------------------------------------------------------------------------ run
    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        extra_info = row.get("extra_info") or {}
        data = AgentData(
            messages=[dict(m) for m in row["raw_prompt"]],
            request_id=row["request_id"],
            tools_kwargs=dict(extra_info.get("tools_kwargs") or {}),
            image_data=list((row.get("multi_modal_data") or {}).get("image") or []),
        )
        self._select_tools(data, extra_info.get("tool_selection"))
        data.interaction_kwargs = dict(extra_info.get("interaction_kwargs") or {})
        instance = None
        if self.interactions:
            name = data.interaction_kwargs.get("name") or next(iter(self.interactions))
            if name not in self.interactions:
                raise ValueError(
                    f"extra_info.interaction_kwargs.name: unknown interaction '{name}'; "
                    f"configured: {', '.join(self.interactions)}"
                )
            data.interaction = self.interactions[name]
            instance = await data.interaction.start_interaction(data.request_id, **data.interaction_kwargs)
        try:
            state = AgentState.PENDING
            while state != AgentState.TERMINATED:
                if state == AgentState.PENDING:
                    state = await self._handle_pending(data)
                elif state == AgentState.GENERATING:
                    state = await self._handle_generating(data, sampling_params)
                elif state == AgentState.PROCESSING_TOOLS:
                    state = await self._handle_processing_tools(data)
                elif state == AgentState.INTERACTING:
                    assert instance is not None  # only an agent with an interaction (started above) gets here
                    state = await self._handle_interacting(data, instance)
                else:  # pragma: no cover - every state is handled above
                    logger.error("invalid agent state %s; terminating", state)
                    state = AgentState.TERMINATED
        finally:
            if instance is not None:
                await data.interaction.finalize_interaction(instance)
        return self._output(data)

    def _select_tools(self, data: AgentData, selection: Any) -> None:
        if selection is None:
            data.active_tools = dict(self.tools)
        else:
            unknown = [name for name in selection if name not in self.tools]
            if unknown:
                raise ValueError(
                    f"extra_info.tool_selection names unknown tools {unknown}; "
                    f"configured: {', '.join(self.tools) or '(none)'}"
                )
            data.active_tools = {name: self.tools[name] for name in selection}
        data.tool_schemas = [tool.tool_schema for tool in data.active_tools.values()]

    def _assistant_text(self, ids: list[int]) -> str:
        """The turn as chat history text: tool calls kept, the final EOS (which the template re-adds) dropped."""
        eos = self.tokenizer.eos_token_id
        return self.tokenizer.decode(ids[:-1] if ids and ids[-1] == eos else ids, skip_special_tokens=False)

    def _output(self, data: AgentData) -> AgentLoopOutput:
        start = data.extra_fields["prompt_len"]
        limit = self.response_length
        data.metrics.update(assistant_turns=float(data.assistant_turns), user_turns=float(data.user_turns))
        return AgentLoopOutput(
            prompt_ids=data.prompt_ids[:start],
            response_ids=data.prompt_ids[start:][:limit],
            response_mask=data.response_mask[:limit],
            response_logprobs=data.response_logprobs[:limit],
            num_turns=data.user_turns + data.assistant_turns + 1,
            metrics=data.metrics,
            extra_fields={
                "turn_scores": list(data.turn_scores),
                "tool_rewards": list(data.tool_rewards),
                "messages": data.messages,
            },
            multi_modal_inputs=self._vision(data),
        )

    def _budget(self, data: AgentData) -> int:
        return self.response_length - len(data.response_mask)

    def _turn_limit_reached(self, data: AgentData) -> bool:
        cfg = self.config
        return bool(
            (cfg.max_assistant_turns and data.assistant_turns >= cfg.max_assistant_turns)
            or (cfg.max_user_turns and data.user_turns >= cfg.max_user_turns)
        )

    def _append(self, data: AgentData, ids: list[int]) -> bool:
        """Append non-model tokens (mask 0); False (and nothing appended) when they do not fit the budget with
        room for at least one more model token."""
        if len(ids) >= self._budget(data):
            data.count("truncated_by_length")
            return False
        data.prompt_ids += ids
        data.response_mask += [0] * len(ids)
        data.response_logprobs += [0.0] * len(ids)
        return True

    # --------------------------------------------------------------------------------------------- states
    async def _handle_pending(self, data: AgentData) -> AgentState:
        if data.image_data:  # the dataset gave the messages their image items (scaletrain/data/vision.py)
            data.prompt_ids, inputs = self._render_prompt_with_images(data)
            data.vision_inputs.append(inputs)
        else:
            data.prompt_ids = self.apply_chat_template(data.messages, tools=data.tool_schemas or None)
        self.check_prompt(data.prompt_ids, {"request_id": data.request_id})
        data.extra_fields["prompt_len"] = len(data.prompt_ids)
        return AgentState.GENERATING

    def _render_prompt_with_images(self, data: AgentData) -> tuple[list[int], dict[str, Any]]:
        from scaletrain.data.vision import encode_prompt

        if self.processor is None:
            raise ValueError(f"row {data.request_id}: the prompt has images but the model has no processor")
        kwargs = {"tools": data.tool_schemas} if data.tool_schemas else {}
        return encode_prompt(self.processor, data.messages, data.image_data, kwargs)

    def _vision(self, data: AgentData) -> dict[str, Any] | None:
        """Every image of the trajectory so far, its vision inputs in order; None without images."""
        return gather_vision_inputs(data.vision_inputs, "cpu") or None

    async def _handle_generating(self, data: AgentData, sampling_params: dict[str, Any]) -> AgentState:
        params = {**sampling_params, "max_new_tokens": self._budget(data)}
        if params.get("seed") is not None:  # a fresh stream per turn, still reproducible
            params["seed"] = derive_seed(int(params["seed"]), data.assistant_turns)
        out = await self.generate(data.request_id, data.prompt_ids, params, self._vision(data))
        data.assistant_turns += 1
        data.response_ids = list(out.token_ids)
        data.prompt_ids += data.response_ids
        data.response_mask += [1] * len(data.response_ids)
        data.response_logprobs += list(out.log_probs)
        data.messages.append({"role": "assistant", "content": self._assistant_text(data.response_ids)})
        if self._budget(data) <= 0 or out.finish_reason != "stop" or self._turn_limit_reached(data):
            return AgentState.TERMINATED
        _, calls, bad = await self.parser.extract_tool_calls(data.response_ids)
        data.count("parse_errors", bad)
        if calls:
            data.tool_calls = calls
            return AgentState.PROCESSING_TOOLS
        if data.interaction is not None:
            return AgentState.INTERACTING
        return AgentState.TERMINATED

    async def _handle_processing_tools(self, data: AgentData) -> AgentState:
        calls = data.tool_calls[: self.config.max_parallel_calls]
        data.count("tool_calls_dropped", len(data.tool_calls) - len(calls))
        data.tool_calls = []
        results = await asyncio.gather(*(self._call_tool(call, data) for call in calls))
        messages, images = [], []
        for response, reward, _ in results:
            text = truncate_text(
                response.text or "", self.config.max_tool_response_length, self.config.tool_response_truncate_side
            )
            message, shown = self._tool_message(text, response.image, data)
            messages.append(message)
            images += shown
            data.tool_rewards.append(float(reward))
        data.messages += messages
        data.user_turns += 1
        if images:
            ids, inputs = self.render_turn_with_images(messages, images)
        else:
            ids, inputs = self.render_turn(messages), {}
        appended = self._append(data, ids)
        if appended and images:  # its images join the trajectory's, in order (whatever comes next)
            data.image_data += images
            data.vision_inputs.append(inputs)
        if not appended or self._turn_limit_reached(data):
            return AgentState.TERMINATED
        if any(fatal for _, _, fatal in results):
            return AgentState.TERMINATED
        return AgentState.GENERATING

    def _tool_message(self, text: str, image: Any, data: AgentData) -> tuple[dict[str, Any], list[Any]]:
        """A tool's answer as a chat message, and the images it shows the model: a vision-language model sees
        them (one image item each, before the text, as verl renders them); a text model cannot, so they are
        dropped and counted (``agent/tool_images_dropped``)."""
        from scaletrain.data.vision import decode_images

        images = [] if image is None else list(image) if isinstance(image, (list, tuple)) else [image]
        if not images:
            return {"role": "tool", "content": text}, []
        if self.processor is None:
            data.count("tool_images_dropped", len(images))
            return {"role": "tool", "content": text}, []
        try:
            images = decode_images(images, "the tool's image")
        except ValueError as exc:  # a tool's bad output is the model's to see, as a tool error is
            data.count("tool_errors")
            return {"role": "tool", "content": f"Error: {exc}"}, []
        content = [{"type": "image"} for _ in images] + ([{"type": "text", "text": text}] if text else [])
        return {"role": "tool", "content": content}, images

    async def _call_tool(self, call: FunctionCall, data: AgentData) -> tuple[ToolResponse, float, bool]:
        """(answer to the model, reward, fatal); fatal: the tool could not be created in time, the trajectory ends."""
        data.count("tool_calls")
        tool = data.active_tools.get(call.name)
        if tool is None:
            data.count("tool_errors")
            return ToolResponse(text=f"Error: unknown tool '{call.name}'"), 0.0, False
        data.count(f"tool_calls/{call.name}")
        try:
            args = json.loads(call.arguments)
        except json.JSONDecodeError as exc:
            data.count("tool_errors")
            return ToolResponse(text=f"Error: arguments of '{call.name}' are not JSON: {exc}"), 0.0, False
        try:
            create_kwargs = (data.tools_kwargs.get(call.name) or {}).get("create_kwargs") or {}
            instance_id, _ = await create_with_timeout(tool, **create_kwargs)
        except ToolLifecycleTimeout as exc:
            # a tool that cannot even be created (its service hangs) would stall every further call the same way
            data.count("tool_errors")
            data.count("tool_create_timeouts")
            logger.warning("trajectory %s ends: %s", data.request_id, exc)
            return ToolResponse(text=f"Error: {exc}; the conversation ends here"), 0.0, True
        except Exception as exc:
            data.count("tool_errors")
            logger.debug("tool %s: create failed: %s", call.name, exc, exc_info=True)
            text = f"Error when executing tool '{call.name}': {type(exc).__name__}: {exc}"
            return ToolResponse(text=text), 0.0, False
        try:
            response, reward = await self._execute_tool(tool, call.name, instance_id, args, data)
        finally:
            await self._release_tool(tool, instance_id, data)
        return response, reward, False

    async def _execute_tool(
        self, tool: BaseTool, name: str, instance_id: str, args: dict, data: AgentData
    ) -> tuple[ToolResponse, float]:
        try:
            response, reward, metrics = await asyncio.wait_for(
                tool.execute(instance_id, args, agent_data=data), self.config.tool_timeout_s
            )
            metrics = metrics or {}
            if metrics.get("error"):
                data.count("tool_errors")
            for key, value in metrics.items():  # a tool's own counters (e.g. code_runner/no_network_isolation)
                if key != "error" and isinstance(value, (int, float)):
                    data.count(key, float(value))
            return response, float(reward)
        except asyncio.TimeoutError:
            data.count("tool_errors")
            data.count("tool_timeouts")
            return ToolResponse(text=f"Error: tool '{name}' timed out after {self.config.tool_timeout_s} s"), 0.0
        except Exception as exc:
            data.count("tool_errors")
            logger.debug("tool %s failed: %s", name, exc, exc_info=True)
            return ToolResponse(text=f"Error when executing tool '{name}': {type(exc).__name__}: {exc}"), 0.0

    async def _release_tool(self, tool: BaseTool, instance_id: str, data: AgentData) -> None:
        """Release (bounded by the tool's release_timeout_s); a failure is logged and counted, never raised: the
        answer is already there."""
        try:
            await release_with_timeout(tool, instance_id)
        except ToolLifecycleTimeout as exc:
            data.count("tool_release_timeouts")
            logger.warning("trajectory %s: %s", data.request_id, exc)
        except Exception as exc:
            data.count("tool_release_errors")
            logger.warning("tool %s: release(%s) failed: %s", tool.name, instance_id, exc)

    async def _handle_interacting(self, data: AgentData, instance: str) -> AgentState:
        done, response, reward, _ = await data.interaction.generate_response(
            instance, data.messages, **data.interaction_kwargs
        )
        data.turn_scores.append(float(reward))
        data.user_turns += 1
        if done or self._turn_limit_reached(data):
            return AgentState.TERMINATED
        message = {"role": "user", "content": str(response)}
        data.messages.append(message)
        return AgentState.GENERATING if self._append(data, self.render_turn([message])) else AgentState.TERMINATED
