"""``ServiceClient``: JSON requests to a remote reward service (the judge: judge.py; the code sandbox:
sandbox_fusion.py; a reward model: remote_rm.py) with the limits a shared service needs.

Every request goes through a concurrency limit (``max_concurrent`` in flight) and, with ``max_rpm``, a token bucket
of that many requests per minute (verl's ``limited`` reward manager's limits); each has a timeout (``timeout_s``)
and up to ``max_retries`` retries with exponential backoff (``backoff_s``, doubled each time) after a timeout, a
connection error, HTTP 429 or a 5xx; any other HTTP error, or a reply that is not JSON, fails at once. A failure
raises the client's error class naming the service, its URL and the last problem. The API key (a Bearer token)
comes from an environment variable and is never logged or shown. Connections and limits belong to the event loop
of the first request (the reward manager's scoring loop). Counters ``requests``, ``retries``, ``failures``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

RETRIED_STATUS = {429, 500, 502, 503, 504}


class ServiceError(RuntimeError):
    """A request to a reward service failed after its retries, or its reply was not what the service answers."""


@dataclass
class RetrySettings:
    """A service's request keys, shared by its config section (``reward.judge``, ``reward.sandbox_fusion``,
    ``reward.remote_rm``)."""

    max_rpm: float | None = None  # requests per minute (a token bucket); null: unlimited
    timeout_s: float = 60.0  # seconds one request may take (a sandbox's: the program's run included)
    max_retries: int = 3  # retries after a timeout, a connection error, HTTP 429 or 5xx
    backoff_s: float = 0.5  # the first retry's delay, doubled for each further one


def check_service_settings(
    section: str, url_key: str, url_example: str, settings: RetrySettings, positive: Mapping[str, float]
) -> None:
    """A service's config section before anything starts: ValueError naming the key of a bad value (its URL
    ``<section>.<url_key>``, the ``positive`` numbers, the retry settings)."""
    url = getattr(settings, url_key)
    parsed = urlparse(url or "")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"{section}.{url_key} must be an http(s) URL ({url_example}): {url!r}")
    rpm = {} if settings.max_rpm is None else {"max_rpm": settings.max_rpm}
    for key, value in {**positive, **rpm, "timeout_s": settings.timeout_s}.items():
        if not value > 0:
            raise ValueError(f"{section}.{key} must be positive, got {value}")
    for key, value in {"max_retries": settings.max_retries, "backoff_s": settings.backoff_s}.items():
        if value < 0:
            raise ValueError(f"{section}.{key} must be >= 0, got {value}")


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


class ServiceClient:
    """Requests to ``url`` (a base URL: ``request``'s ``path`` is appended) as ``name`` ("the judge"), with the
    settings of config section ``config_key`` (named in errors)."""

    def __init__(
        self,
        name: str,
        url: str,
        config_key: str,
        settings: RetrySettings,
        max_concurrent: int,
        api_key_env: str | None = None,
        error_cls: type[ServiceError] = ServiceError,
    ) -> None:
        self.name, self.url, self.config_key, self.error_cls = name, url.rstrip("/"), config_key, error_cls
        self.settings, self.max_concurrent, self.max_rpm = settings, max_concurrent, settings.max_rpm
        if api_key_env and api_key_env not in os.environ:  # e.g. a reward worker on a node started without it
            raise ValueError(f"{config_key}.api_key_env: the environment variable {api_key_env} is not set here")
        self._key = os.environ.get(api_key_env) if api_key_env else None
        self._client: Any = None
        self._slots: asyncio.Semaphore | None = None
        self._bucket: TokenBucket | None = None
        self.counts = {"requests": 0, "retries": 0, "failures": 0}

    def __repr__(self) -> str:  # no key
        return f"ServiceClient({self.name!r}, {self.url!r})"

    def fail(self, message: str) -> ServiceError:
        """The client's error for a reply that is not what the service answers (counted as a failure)."""
        self.counts["failures"] += 1
        return self.error_cls(f"{self.name} at {self.url} {message}")

    def metrics(self, prefix: str) -> dict[str, float]:
        """The counters since the last call as ``<prefix>/<counter>``, reset."""
        out = {f"{prefix}/{k}": float(v) for k, v in self.counts.items()}
        self.counts = dict.fromkeys(self.counts, 0)
        return out

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _limits(self) -> tuple[Any, asyncio.Semaphore, TokenBucket | None]:
        import httpx

        if self._client is None:
            headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
            self._client = httpx.AsyncClient(headers=headers, timeout=self.settings.timeout_s)
            self._slots = asyncio.Semaphore(self.max_concurrent)
            rpm = self.max_rpm
            self._bucket = TokenBucket(rpm / 60.0, max(1.0, rpm / 60.0)) if rpm else None
        assert self._slots is not None
        return self._client, self._slots, self._bucket

    async def request(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        """The JSON reply of one request, retried as the module docstring says; the error class when it fails."""
        client, slots, bucket = self._limits()
        last, attempt = "", 0
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
        raise self.error_cls(f"{self.name} at {self.url}{path} failed ({attempt + 1} tries): {last}")

    async def _attempt(self, client: Any, method: str, path: str, body: dict[str, Any] | None):
        """(retry?, what went wrong, the JSON reply or None) of one try."""
        import httpx

        try:
            response = await client.request(method, self.url + path, json=body)
        except httpx.TimeoutException:
            return True, f"no answer within {self.config_key}.timeout_s={self.settings.timeout_s:g}s", None
        except httpx.TransportError as e:
            return True, f"{type(e).__name__}: {e}", None
        if response.status_code != 200:
            what = f"HTTP {response.status_code}: {response.text[:200]!r}"
            return response.status_code in RETRIED_STATUS, what, None
        try:
            return False, "", response.json()
        except ValueError:
            return False, f"the reply is not JSON: {response.text[:200]!r}", None
