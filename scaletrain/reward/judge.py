"""A generative judge behind an OpenAI-compatible endpoint (``reward.judge.*``): the handle an async reward function
awaits, with the limits a shared service needs.

    async def compute_score(data_source, solution_str, ground_truth, extra_info=None, judge=None):
        reply = await judge.chat([{"role": "user", "content": f"Is {solution_str!r} equal to {ground_truth}?"}])
        return 1.0 if reply.strip().lower().startswith("yes") else 0.0

``judge.chat(messages, **params)`` posts ``{model, messages, **params}`` to ``<base_url>/chat/completions`` (vLLM's
``vllm serve``, an OpenAI-compatible gateway, ...) and returns the first choice's text. Every request goes through
the limits of http_service.py: ``max_concurrent`` in flight, a token bucket of ``max_rpm`` requests per minute,
a per-request timeout (``timeout_s``) and ``max_retries`` retries with exponential backoff (``backoff_s``) after a
timeout, a connection error, HTTP 429 or a 5xx. A reply that is not a chat completion (not JSON, no
``choices[0].message.content`` string) fails naming the endpoint and the reply's start.

A failure raises JudgeError: the reward manager counts the sample as an error (``reward/errors``) and the run's
reward guard stops a run whose judge keeps failing (``reward_model.max_error_rate`` / ``max_error_steps``). The API
key comes from the environment variable ``api_key_env`` names (a Bearer token); it is never logged or shown in an
error. ``model`` null: the endpoint's first served model (``GET <base_url>/models``, asked once). Counters:
``judge/requests``, ``judge/retries``, ``judge/failures`` per scoring call (``metrics()``).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from scaletrain.reward.http_service import RetrySettings, ServiceClient, ServiceError, check_service_settings


@dataclass
class JudgeSettings(RetrySettings):
    """``reward.judge``: the endpoint and its limits (module docstring)."""

    base_url: str | None = None  # an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1; null: no judge
    model: str | None = None  # the model name sent with each request; null: the endpoint's first served model
    api_key_env: str | None = None  # the environment variable holding the API key (sent as a Bearer token, never
    # logged); null: no key
    max_concurrent: int = 8  # requests in flight at once

    @property
    def enabled(self) -> bool:
        return self.base_url is not None

    def router_address(self) -> str:
        """``HOST:PORT`` of the endpoint: verl's ``reward_router_address`` for GenRM functions written for verl."""
        url = urlparse(self.base_url or "")
        return url.netloc


def check_judge_settings(settings: JudgeSettings) -> None:
    """``reward.judge.*`` before anything starts: ValueError naming the key of a bad value (the API key's
    variable must be set; its value is never shown)."""
    positive: dict[str, float] = {"max_concurrent": settings.max_concurrent}
    check_service_settings("reward.judge", "base_url", "http://HOST:PORT/v1", settings, positive)
    if settings.api_key_env and settings.api_key_env not in os.environ:
        raise ValueError(f"reward.judge.api_key_env: the environment variable {settings.api_key_env} is not set")


class JudgeError(ServiceError):
    """A judge request failed after its retries, or its reply was not a chat completion."""


class Judge:
    """The judge handle (module docstring). Its connections and limits belong to the event loop of its first
    request (the reward manager's scoring loop)."""

    def __init__(self, settings: JudgeSettings) -> None:
        if settings.base_url is None:
            raise ValueError("reward.judge.base_url is not set")
        self.settings = settings
        s, url = settings, settings.base_url
        args = ("the judge", url, "reward.judge", s, s.max_concurrent, s.api_key_env, JudgeError)
        self.service = ServiceClient(*args)
        self.url = self.service.url
        self._model = settings.model
        self._asking: asyncio.Lock | None = None

    def __repr__(self) -> str:  # no key
        return f"Judge({self.url!r}, model={self._model!r})"

    async def chat(self, messages: list[dict[str, Any]], **params: Any) -> str:
        """The first choice's text of a chat completion of ``messages`` (``params``: max_tokens, temperature, ...)."""
        body = {"model": await self.model(), "messages": messages, **params}
        reply = await self.service.request("POST", "/chat/completions", body)
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            content = None
        if not isinstance(content, str):
            raise self.service.fail(f"answered something that is not a chat completion: {reply!r:.200}")
        return content

    async def model(self) -> str:
        """``reward.judge.model``, or the endpoint's first served model (asked once)."""
        if self._model is None:
            if self._asking is None:  # made on the scoring loop (a Lock binds to the loop it is first used on)
                self._asking = asyncio.Lock()
            async with self._asking:  # concurrent first calls: one asks, the others wait for its answer
                if self._model is None:
                    served = await self.service.request("GET", "/models", None)
                    try:
                        self._model = str(served["data"][0]["id"])
                    except (KeyError, IndexError, TypeError):
                        raise self.service.fail(f"lists no model at /models: {served!r:.200}") from None
        return self._model

    def metrics(self) -> dict[str, float]:
        """The counters since the last call (``judge/*``), reset."""
        return self.service.metrics("judge")

    async def aclose(self) -> None:
        await self.service.aclose()


JUDGE_PARAMETERS = ("judge", "reward_router_address")


def bind_judge(fn: Any, judge: Judge) -> Any:
    """``fn`` with the judge bound: ``judge=`` the handle and/or ``reward_router_address=`` the endpoint's
    ``HOST:PORT`` (verl's GenRM functions), whichever it takes. ValueError naming the function when it is not an
    ``async def`` or takes neither."""
    import functools
    import inspect

    from scaletrain.reward.async_scorer import is_async_scorer, target_function

    target = target_function(fn)
    if not is_async_scorer(fn):
        raise ValueError(
            f"reward.judge.base_url is set but the reward function {fn!r} is not an async def: it calls the judge "
            "with `await judge.chat(...)`"
        )
    params = inspect.signature(target).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    bound = {"judge": judge, "reward_router_address": judge.settings.router_address()}
    bound = {k: v for k, v in bound.items() if k in params or takes_any}
    if not bound:
        raise ValueError(
            f"reward.judge.base_url is set but the reward function {fn!r} takes none of {list(JUDGE_PARAMETERS)}"
        )
    return functools.partial(fn, **bound)
