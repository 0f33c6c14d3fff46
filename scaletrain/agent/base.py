"""Agent-loop building blocks: the state machine's states, per-trajectory data, the loop output and the registry.

An agent loop turns one dataset row into one trajectory: it renders the prompt, asks the rollout servers for
tokens (``await server_manager.generate(request_id, prompt_ids, sampling_params)``), may call tools or a
simulated user in between, and returns an ``AgentLoopOutput``: the prompt ids, the response ids (model tokens
exactly as generated, interleaved with template-rendered tool / user tokens), a mask (1 = model token, 0 = not)
and the rollout log-prob of every model token. With a vision-language model (``processor`` set) the prompt's images
(the row's ``multi_modal_inputs``) and those a tool answers with go to the server with the ids, and the output
carries them all, in order, for the trainer's forward (``AgentLoopOutput.multi_modal_inputs``). Loops are registered
by name and picked per row by the ``agent_name`` column::

    @register_agent_loop("my_agent")
    class MyAgentLoop(AgentLoopBase):
        async def run(self, sampling_params, **row) -> AgentLoopOutput: ...
"""

from __future__ import annotations

import enum
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from scaletrain.utils.registry import Registry

TEMPLATE_CACHE_SIZE = 4096
AGENT_LOOPS = Registry(
    "agent loop",
    lazy={"single_turn_agent": "scaletrain.agent.single_turn", "tool_agent": "scaletrain.agent.tool_agent"},
)


def register_agent_loop(name: str):
    """Class decorator: make an AgentLoopBase subclass selectable as ``agent_name=<name>``."""
    return AGENT_LOOPS.register(name)


def get_agent_loop(name: str) -> type:
    return AGENT_LOOPS.get(name)


class AgentState(str, enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


@dataclass
class AgentLoopOutput:
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]  # 1: model token, 0: tool / user token
    response_logprobs: list[float]  # rollout log-prob of each response token (0 where mask is 0)
    num_turns: int = 2  # user + assistant turns (and tool turns), the prompt counted
    metrics: dict[str, float] = field(default_factory=dict)
    extra_fields: dict[str, Any] = field(default_factory=dict)
    # a vision-language model's inputs for every image in prompt + response, in order; None: no images
    multi_modal_inputs: dict[str, Any] | None = None


@dataclass
class AgentData:
    """Everything one trajectory of the tool agent carries between states."""

    messages: list[dict]
    request_id: str
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)  # the whole sequence so far
    response_ids: list[int] = field(default_factory=list)  # the last model turn's tokens
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    tool_rewards: list[float] = field(default_factory=list)
    user_turns: int = 0
    assistant_turns: int = 0
    tool_calls: list = field(default_factory=list)
    active_tools: dict[str, Any] = field(default_factory=dict)
    tool_schemas: list[dict] = field(default_factory=list)
    interaction: Any = None
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    extra_fields: dict[str, Any] = field(default_factory=dict)
    image_data: list[Any] = field(default_factory=list)  # the images so far (PIL), the prompt's and the tools'
    vision_inputs: list[dict[str, Any]] = field(default_factory=list)  # their processor inputs, one per render

    def count(self, key: str, value: float = 1.0) -> None:
        self.metrics[key] = self.metrics.get(key, 0.0) + value


class AgentLoopBase:
    """Base of every agent loop. ``config`` is the ``multi_turn`` settings (``MultiTurnConfig``),
    ``server_manager`` answers ``await generate(request_id, prompt_ids, sampling_params)`` with a
    ``TokenOutput``, ``tokenizer`` renders chat messages. ``response_length`` bounds the whole response.
    ``processor``: a vision-language model's (renders messages with images), None for a text model."""

    def __init__(
        self,
        config,
        server_manager,
        tokenizer,
        *,
        response_length: int,
        prompt_length: int | None = None,
        processor: Any = None,
        **kwargs: Any,
    ) -> None:
        self.config = config
        self.processor = processor
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.response_length = int(response_length)
        self.prompt_length = prompt_length  # None: unchecked
        self.kwargs = kwargs

    def check_prompt(self, prompt_ids: list[int], row: dict[str, Any]) -> list[int]:
        """The rendered prompt, or ValueError naming the row when it exceeds ``prompt_length`` (the engines size
        their context as prompt_length + response_length)."""
        if self.prompt_length is not None and len(prompt_ids) > self.prompt_length:
            raise ValueError(
                f"row {row.get('request_id')}: the rendered prompt has {len(prompt_ids)} tokens, more "
                f"than rollout.prompt_length={self.prompt_length} (tool schemas count); raise "
                f"data.max_prompt_length"
            )
        return prompt_ids

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        raise NotImplementedError

    # -------------------------------------------------------------------------------------------- helpers
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: dict[str, Any], vision: dict[str, Any] | None
    ):
        """The server's sample continuing ``prompt_ids``, given the images in them (``vision``; None: none: the
        server's three-argument call, as servers written for text models take it)."""
        if vision:
            return await self.server_manager.generate(request_id, prompt_ids, params, multi_modal_inputs=vision)
        return await self.server_manager.generate(request_id, prompt_ids, params)

    def apply_chat_template(
        self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered messages (memoised: the n samples of a prompt render it once)."""
        key = json.dumps([messages, tools, add_generation_prompt], sort_keys=True, default=str)
        cache = self.__dict__.setdefault("_template_cache", OrderedDict())
        if key in cache:
            cache.move_to_end(key)
            return list(cache[key])
        kwargs = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        cache[key] = ids
        if len(cache) > TEMPLATE_CACHE_SIZE:
            cache.popitem(last=False)
        return list(ids)

    def render_turn(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` (tool results / a user reply) appended after a finished assistant turn,
        followed by the generation prompt. Rendered as the difference between a fixed context with and without
        them, so templates that add a default system prompt or BOS at the start do not repeat it here."""
        base = [{"role": "user", "content": "x"}]
        before = self.apply_chat_template(base, add_generation_prompt=False)
        after = self.apply_chat_template(base + list(messages), add_generation_prompt=True)
        if after[: len(before)] == before:
            return after[len(before) :]
        return self.apply_chat_template(list(messages), add_generation_prompt=True)

    def render_turn_with_images(self, messages: list[dict], images: list[Any]) -> tuple[list[int], dict[str, Any]]:
        """``render_turn`` for messages holding image items: the same difference, taken on the rendered text, then
        encoded by the processor (each image's vision tokens expanded); returns (ids, the images' vision inputs)."""
        from scaletrain.data.vision import encode_text

        assert self.processor is not None  # only a vision-language model's loop renders images
        base = [{"role": "user", "content": "x"}]
        render = self.processor.apply_chat_template
        before = render(base, add_generation_prompt=False, tokenize=False)
        after = render(base + list(messages), add_generation_prompt=True, tokenize=False)
        if not after.startswith(before):
            after, before = render(list(messages), add_generation_prompt=True, tokenize=False), ""
        return encode_text(self.processor, after[len(before) :], images)
