"""A generative judge behind an OpenAI-compatible endpoint (``reward.judge.*``): the handle an async reward function
awaits, with the limits a shared service needs.

    async def compute_score(data_source, solution_str, ground_truth, extra_info=None, judge=None):
        reply = await judge.chat([{"role": "user", "content": f"Is {solution_str!r} equal to {ground_truth}?"}])
        return 1.0 if reply.strip().lower().startswith("yes") else 0.0

``judge.chat(messages, **params)`` posts ``{model, messages, **params}`` to ``<base_url>/chat/completions`` (vLLM's
``vllm serve``, an OpenAI-compatible gateway, ...) and returns the first choice's text. Every request goes through:

- a concurrency limit (``max_concurrent`` requests in flight) and, with ``max_rpm``, a token bucket of that many
  requests per minute (verl's ``limited`` reward manager's limits);
- a per-request timeout (``timeout_s``) and up to ``max_retries`` retries with exponential backoff (``backoff_s``,
  doubled each time) after a timeout, a connection error, HTTP 429 or a 5xx; any other HTTP error fails at once;
- a reply that is not a chat completion (not JSON, no ``choices[0].message.content`` string) fails naming the
  endpoint and the reply's start.

A failure raises JudgeError: the reward manager counts the sample as an error (``reward/errors``) and the run's
reward guard stops a run whose judge keeps failing (``reward_model.max_error_rate`` / ``max_error_steps``). The API
key comes from the environment variable ``api_key_env`` names (a Bearer token); it is never logged or shown in an
error. ``model`` null: the endpoint's first served model (``GET <base_url>/models``, asked once). Counters:
``judge/requests``, ``judge/retries``, ``judge/failures`` per scoring call (``metrics()``).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

RETRIED_STATUS = {429, 500, 502, 503, 504}


@dataclass
class JudgeSettings:
    """``reward.judge``: the endpoint and its limits (module docstring)."""

    base_url: str | None = None  # an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1; null: no judge
    model: str | None = None  # the model name sent with each request; null: the endpoint's first served model
    api_key_env: str | None = None  # the environment variable holding the API key (sent as a Bearer token, never
    # logged); null: no key
    max_concurrent: int = 8  # requests in flight at once
    max_rpm: float | None = None  # requests per minute (a token bucket); null: unlimited
    timeout_s: float = 60.0  # seconds one request may take
    max_retries: int = 3  # retries after a timeout, a connection error, HTTP 429 or 5xx
    backoff_s: float = 0.5  # the first retry's delay, doubled for each further one

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
    url = urlparse(settings.base_url or "")
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ValueError(f"reward.judge.base_url must be an http(s) URL (http://HOST:PORT/v1): {settings.base_url!r}")
    if settings.api_key_env and settings.api_key_env not in os.environ:
        raise ValueError(f"reward.judge.api_key_env: the environment variable {settings.api_key_env} is not set")
    positive = {"max_concurrent": settings.max_concurrent, "timeout_s": settings.timeout_s}
    if settings.max_rpm is not None:
        positive["max_rpm"] = settings.max_rpm
    for key, value in positive.items():
        if value <= 0:
            raise ValueError(f"reward.judge.{key} must be positive, got {value}")
    for key in ("max_retries", "backoff_s"):
        if getattr(settings, key) < 0:
            raise ValueError(f"reward.judge.{key} must be >= 0, got {getattr(settings, key)}")


class JudgeError(RuntimeError):
    """A judge request failed after its retries, or its reply was not a chat completion."""


class TokenBucket:
    """``rate`` tokens per second, at most ``capacity`` saved; ``acquire`` waits for one (single event loop)."""

    def __init__(self, rate: float, capacity: float) -> None:
        self.rate, self.capacity = rate, capacity
        self.tokens, self.last = capacity, time.monotonic()

    async def acquire(self) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
            self.last = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return
            await asyncio.sleep((1.0 - self.tokens) / self.rate)


class Judge:
    """The judge handle (module docstring). Its connections and limits belong to the event loop of its first
    request (the reward manager's scoring loop)."""

    def __init__(self, settings: JudgeSettings) -> None:
        if settings.base_url is None:
            raise ValueError("reward.judge.base_url is not set")
        self.settings = settings
        self.url = settings.base_url.rstrip("/")
        self._key = os.environ.get(settings.api_key_env) if settings.api_key_env else None
        self._model = settings.model
        self._client: Any = None
        self._slots: asyncio.Semaphore | None = None
        self._asking: asyncio.Lock | None = None
        self._bucket: TokenBucket | None = None
        self.counts = {"requests": 0, "retries": 0, "failures": 0}

    def __repr__(self) -> str:  # no key
        return f"Judge({self.url!r}, model={self._model!r})"

    async def chat(self, messages: list[dict[str, Any]], **params: Any) -> str:
        """The first choice's text of a chat completion of ``messages`` (``params``: max_tokens, temperature, ...)."""
        body = {"model": await self.model(), "messages": messages, **params}
        reply = await self._request("POST", "/chat/completions", body)
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            content = None
        if not isinstance(content, str):
            self.counts["failures"] += 1
            raise JudgeError(
                f"the judge at {self.url} answered something that is not a chat completion: {reply!r:.200}"
            )
        return content

    async def model(self) -> str:
        """``reward.judge.model``, or the endpoint's first served model (asked once)."""
        if self._model is None:
            self._limits()
            assert self._asking is not None
            async with self._asking:  # concurrent first calls: one asks, the others wait for its answer
                if self._model is None:
                    served = await self._request("GET", "/models", None)
                    try:
                        self._model = str(served["data"][0]["id"])
                    except (KeyError, IndexError, TypeError):
                        what = f"{served!r:.200}"
                        raise JudgeError(f"the judge at {self.url} lists no model at /models: {what}") from None
        return self._model

    def metrics(self) -> dict[str, float]:
        """The counters since the last call (``judge/*``), reset."""
        out = {f"judge/{k}": float(v) for k, v in self.counts.items()}
        self.counts = dict.fromkeys(self.counts, 0)
        return out

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ------------------------------------------------------------------------------------------ requests
    def _limits(self) -> tuple[Any, asyncio.Semaphore, TokenBucket | None]:
        import httpx

        if self._client is None:
            headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
            self._client = httpx.AsyncClient(headers=headers, timeout=self.settings.timeout_s)
            self._slots = asyncio.Semaphore(self.settings.max_concurrent)
            self._asking = asyncio.Lock()
            rpm = self.settings.max_rpm
            self._bucket = TokenBucket(rpm / 60.0, max(1.0, rpm / 60.0)) if rpm else None
        assert self._slots is not None
        return self._client, self._slots, self._bucket

    async def _request(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        """The JSON reply of one request, retried as the module docstring says; JudgeError when it fails."""
        client, slots, bucket = self._limits()
        last = ""
        for attempt in range(self.settings.max_retries + 1):
            if attempt:
                self.counts["retries"] += 1
                await asyncio.sleep(self.settings.backoff_s * 2 ** (attempt - 1))
            if bucket is not None:
                await bucket.acquire()
            self.counts["requests"] += 1
            async with slots:
                retry, last, reply = await self._attempt(client, method, path, body)
            if not retry:
                if reply is not None:
                    return reply
                break
        self.counts["failures"] += 1
        tries = attempt + 1
        raise JudgeError(f"the judge at {self.url}{path} failed ({tries} tries): {last}")

    async def _attempt(self, client: Any, method: str, path: str, body: dict[str, Any] | None):
        """(retry?, what went wrong, the JSON reply or None) of one try."""
        import httpx

        try:
            response = await client.request(method, self.url + path, json=body)
        except httpx.TimeoutException:
            return True, f"no answer within reward.judge.timeout_s={self.settings.timeout_s:g}s", None
        except httpx.TransportError as e:
            return True, f"{type(e).__name__}: {e}", None
        if response.status_code != 200:
            what = f"HTTP {response.status_code}: {response.text[:200]!r}"
            return response.status_code in RETRIED_STATUS, what, None
        try:
            return False, "", response.json()
        except ValueError:
            return False, f"the reply is not JSON: {response.text[:200]!r}", None


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
