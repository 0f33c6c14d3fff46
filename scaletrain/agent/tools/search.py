"""``search``: queries a retrieval HTTP service and shows the model the top passages.

Config keys: ``retrieval_service_url`` (POST endpoint taking ``{"queries": [...], "topk": k}`` and answering
``{"result": [[{"document": {"contents": ...}}, ...]]}``, as ``retrieval_server.py`` serves), ``topk`` (3),
``num_workers`` (threads doing blocking HTTP, 4), ``rate_limit`` (requests per second over all trajectories, 0 =
off), ``timeout`` (seconds per request, 10). An unreachable service or a bad answer comes back as text.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from scaletrain.agent.tools.base import BaseTool, ToolResponse, register_tool


class RateLimiter:
    """At most ``rate`` acquisitions per second (evenly spaced); ``rate <= 0`` disables it."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self.next_time = 0.0
        self.lock = asyncio.Lock()

    async def acquire(self) -> None:
        if not self.interval:
            return
        async with self.lock:
            now = time.monotonic()
            wait = self.next_time - now
            self.next_time = max(now, self.next_time) + self.interval
        if wait > 0:
            await asyncio.sleep(wait)


def post_json(url: str, payload: dict, timeout: float) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read().decode())


def format_passages(docs: list[dict]) -> str:
    lines = []
    for i, doc in enumerate(docs, start=1):
        contents = doc.get("document", doc).get("contents", "") if isinstance(doc, dict) else str(doc)
        lines.append(f"Doc {i}: {contents}")
    return "\n".join(lines) if lines else "No results."


@register_tool("search")
class SearchTool(BaseTool):
    default_schema = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search a document collection and return the most relevant passages.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None) -> None:
        super().__init__(config, tool_schema)
        if "retrieval_service_url" not in self.config:
            raise ValueError("search tool config needs 'retrieval_service_url'")
        self.url = self.config["retrieval_service_url"]
        self.topk = int(self.config.get("topk", 3))
        self.timeout = float(self.config.get("timeout", 10.0))
        self.pool = ThreadPoolExecutor(int(self.config.get("num_workers", 4)), thread_name_prefix="search")
        self.rate = float(self.config.get("rate_limit", 0))
        self._limiters: dict[int, RateLimiter] = {}  # one per event loop

    def _limiter(self) -> RateLimiter:
        loop = id(asyncio.get_running_loop())
        if loop not in self._limiters:
            self._limiters[loop] = RateLimiter(self.rate)
        return self._limiters[loop]

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        query = parameters.get("query")
        if not isinstance(query, str) or not query.strip():
            return ToolResponse(text="Error: 'query' must be a non-empty string"), 0.0, {"error": 1.0}
        await self._limiter().acquire()
        loop = asyncio.get_running_loop()
        try:
            answer = await loop.run_in_executor(
                self.pool, post_json, self.url, {"queries": [query], "topk": self.topk}, self.timeout
            )
            docs = answer["result"][0]
        except Exception as exc:
            return ToolResponse(text=f"Error: search failed: {type(exc).__name__}: {exc}"), 0.0, {"error": 1.0}
        return ToolResponse(text=format_passages(docs)), 0.0, {}
