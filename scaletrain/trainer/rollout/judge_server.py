"""The generative judge's endpoint (layer 4): an OpenAI-compatible chat server in the driver in front of the run's
own judge engines (scaletrain/workers/generative_rm.py), so a reward function reaches them as it reaches any
remote judge: ``await judge.chat(messages)`` (scaletrain/reward/judge.py, with its limits, retries and counters),
or verl's ``reward_router_address`` (``HOST:PORT``, its GenRM functions post ``/v1/chat/completions`` there) from
the driver, its scorer processes or the reward workers alike.

``POST /v1/chat/completions`` renders ``messages`` with the judge model's chat template and generates one reply;
``GET /v1/models`` lists the served model (``reward_model.model.path``). Concurrent requests are gathered into
batches, one token-level call to the judge engines per batch (scaletrain/agent/server.py's AsyncServerManager
over the judge's role), each request bound to the least loaded engine. A request's sampling is its own
(``temperature``, ``top_p``, ``top_k``, ``seed``, ``max_tokens``: at most ``reward_model.rollout.response_length``,
which is also the default); any other field but ``model``, ``n`` (1) and ``stream`` (false) gets HTTP 400 naming it,
as does a prompt longer than ``reward_model.rollout.prompt_length`` tokens. Until the engines are attached (the
worker group starting) a request gets 503, which the judge client retries.

The server listens on 127.0.0.1 on a free port (a multi-node run: the driver node's address, for reward workers
on other nodes). It serves the run's own engines to the run's own reward code: no API key.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from scaletrain.agent.server import AsyncServerManager, TokenRole, WorkerGroupBackend
from scaletrain.workers.rm_config import GenerativeRolloutConfig

logger = logging.getLogger(__name__)
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed"}
ACCEPTED = {"model", "messages", "max_tokens", "max_completion_tokens", "n", "stream", *SAMPLING}
MAX_BODY_BYTES = 16 << 20  # a judge prompt is bounded by prompt_length tokens long before this
REQUEST_TIMEOUT_S = 3600.0  # the client's own timeout ends a request first; this only frees a stuck handler thread


class JudgeRequestError(ValueError):
    """A request the server does not serve: (HTTP status, message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class JudgeServer:
    def __init__(self, tokenizer: Any, model_name: str, settings: GenerativeRolloutConfig, host: str = "127.0.0.1"):
        """``tokenizer``: the judge model's (its chat template renders the messages); ``model_name``: the name
        ``/v1/models`` lists."""
        self.tokenizer, self.model_name, self.settings = tokenizer, model_name, settings
        self.manager: AsyncServerManager | None = None
        self.ids = itertools.count()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="judge-server-loop", daemon=True).start()
        self.httpd = ThreadingHTTPServer((host, 0), _handler(self))
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, name="judge-server", daemon=True).start()
        self.url = f"http://{host}:{self.httpd.server_address[1]}/v1"

    def attach(self, role: TokenRole) -> None:
        """The judge engines' role: requests are served from now on."""
        self.manager = AsyncServerManager(WorkerGroupBackend(role))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.manager is not None:
            asyncio.run_coroutine_threadsafe(self.manager.close(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)

    # ----------------------------------------------------------------------------------------------- chat
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "scaletrain"}]}

    def chat(self, body: Any) -> dict[str, Any]:
        """The chat completion of one request body (JudgeRequestError for one not served)."""
        if self.manager is None:
            raise JudgeRequestError(503, "the judge's engines are starting")
        prompt_ids, params = self.read_request(body)
        request_id = f"judge-{next(self.ids)}"
        future = asyncio.run_coroutine_threadsafe(self._generate(request_id, prompt_ids, params), self.loop)
        out = future.result(timeout=REQUEST_TIMEOUT_S)
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": out.finish_reason}
            ],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(out.token_ids),
                "total_tokens": len(prompt_ids) + len(out.token_ids),
            },
        }

    async def _generate(self, request_id: str, prompt_ids: list[int], params: dict[str, Any]):
        assert self.manager is not None
        try:
            return await self.manager.generate(request_id, prompt_ids, params)
        finally:
            self.manager.release(request_id)

    def read_request(self, body: Any) -> tuple[list[int], dict[str, Any]]:
        """(prompt token ids, sampling parameters) of a request; JudgeRequestError (400/404) naming what is wrong."""
        if not isinstance(body, dict):
            raise JudgeRequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
        unknown = sorted(set(body) - ACCEPTED)
        if unknown:
            raise JudgeRequestError(400, f"unsupported field(s) {unknown}; this server takes {sorted(ACCEPTED)}")
        if body.get("model", self.model_name) != self.model_name:
            raise JudgeRequestError(404, f"model {body['model']!r} is not served here; it serves {self.model_name!r}")
        if body.get("n", 1) != 1 or body.get("stream", False):
            raise JudgeRequestError(400, "one reply per request, not streamed: 'n' must be 1 and 'stream' false")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise JudgeRequestError(400, "'messages' must be a non-empty list of {role, content} objects")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - the template's own error, whatever it is, names the bad message
            raise JudgeRequestError(400, f"'messages' could not be rendered by the chat template: {exc}") from exc
        prompt_ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not prompt_ids:
            raise JudgeRequestError(400, "'messages' rendered to no tokens in the judge model's vocabulary")
        if len(prompt_ids) > self.settings.prompt_length:
            raise JudgeRequestError(
                400,
                f"the prompt is {len(prompt_ids)} tokens, over reward_model.rollout.prompt_length="
                f"{self.settings.prompt_length}",
            )
        return prompt_ids, self._sampling(body)

    def _sampling(self, body: dict[str, Any]) -> dict[str, Any]:
        most = self.settings.response_length
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = most
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise JudgeRequestError(400, f"'max_tokens' must be a positive integer, got {max_tokens!r}")
        params: dict[str, Any] = {"max_new_tokens": min(max_tokens, most)}
        for name, field in SAMPLING.items():
            value = body.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise JudgeRequestError(400, f"'{name}' must be a number, got {value!r}")
            params[field] = int(value) if name in ("top_k", "seed") else float(value)
        return params


def _handler(server: JudgeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            logger.debug("judge server: " + format, *args)

        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout): nobody to tell
                logger.debug("judge server: the client left before its reply")

        def _error(self, status: int, message: str) -> None:
            self._reply(status, {"error": {"message": message, "code": status}})

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/v1/models":
                self._reply(200, server.models())
            else:
                self._error(404, f"no such path {self.path}; served: GET /v1/models, POST /v1/chat/completions")

        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/v1/chat/completions":
                return self._error(404, f"no such path {self.path}; served: POST /v1/chat/completions")
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES:
                    self.close_connection = True
                    return self._error(413, f"the body is {length} bytes, over {MAX_BODY_BYTES}")
                body = json.loads(self.rfile.read(length) or b"null")
                self._reply(200, server.chat(body))
            except json.JSONDecodeError as exc:
                self._error(400, f"the body is not JSON: {exc}")
            except JudgeRequestError as exc:
                self._error(exc.status, str(exc))
            except Exception as exc:  # noqa: BLE001 - an engine failure reaches the client as a 500 naming it
                logger.warning("judge server: a request failed: %r", exc)
                self._error(500, f"the judge's engines failed: {exc!r:.300}")

    return Handler
