"""Tool-call parsers: model output tokens -> (text without the calls, [FunctionCall]).

Parsers are registered by name (the ``actor_rollout_ref.rollout.multi_turn.format`` key)::

    @ToolParser.register("my_format")
    class MyParser(ToolParser):
        async def extract_tool_calls(self, response_ids): ...

``hermes`` reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks. A malformed block (bad
JSON, no name, arguments not an object) is skipped and counted in ``parser.errors``; parsing never raises.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

from scaletrain.utils.registry import Registry

logger = logging.getLogger(__name__)

TOOL_PARSERS = Registry("tool parser")


@dataclass
class FunctionCall:
    name: str
    arguments: str  # a JSON object, as text


class ToolParser:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.errors = 0  # malformed calls skipped so far

    @classmethod
    def register(cls, name: str):
        """Class decorator registering a parser under ``name``."""
        return TOOL_PARSERS.register(name)

    @classmethod
    def get_tool_parser(cls, name: str, tokenizer) -> ToolParser:
        return TOOL_PARSERS.get(name)(tokenizer)

    async def extract_tool_calls(self, response_ids: list[int]) -> tuple[str, list[FunctionCall], int]:
        """(content without tool calls, calls, number of malformed calls skipped)."""
        raise NotImplementedError


@ToolParser.register("hermes")
class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    PATTERN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse_text(self, text: str) -> tuple[str, list[FunctionCall], int]:
        if self.START not in text:
            return text, [], 0
        calls, bad = [], 0
        for block in self.PATTERN.findall(text):
            try:
                obj = json.loads(block)
                name, args = obj["name"], obj.get("arguments", {})
                if isinstance(args, str):  # some models write the arguments as a JSON string
                    args = json.loads(args)
                if not isinstance(name, str) or not name or not isinstance(args, dict):
                    raise ValueError("'name' must be a non-empty string and 'arguments' an object")
                calls.append(FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False)))
            except Exception as exc:  # any malformed call is skipped and counted, never raised
                bad += 1
                logger.debug("hermes: skipping malformed tool call %r: %s", block[:200], exc)
        # an opening tag never closed is malformed too
        bad += max(0, text.count(self.START) - text.count(self.END))
        self.errors += bad
        content = self.PATTERN.sub("", text)
        return content, calls, bad

    async def extract_tool_calls(self, response_ids: list[int]) -> tuple[str, list[FunctionCall], int]:
        text = self.tokenizer.decode(response_ids, skip_special_tokens=False)
        return self.parse_text(text)
