"""A discriminative reward model served over HTTP (``reward.remote_rm.*``): OpenRLHF's remote reward-model protocol,
the one its ``--remote_rm_url`` speaks, so a reward model served elsewhere (another cluster's GPUs, a shared
scoring service) scores the rollouts.

Each request is ``POST <url>`` with ``{"query": [prompt + response, ...], "prompts": [prompt, ...], "labels":
[ground truth, ...]}`` for up to ``batch_size`` samples; the reply is ``{"rewards": [one number per sample]}`` (or
the bare list). Requests go through http_service.py's limits: ``max_concurrent`` in flight, a token bucket of
``max_rpm`` requests per minute, each bounded by ``timeout_s`` and retried ``max_retries`` times with backoff after
a timeout, a connection error, HTTP 429 or 5xx. A reply that is not that many numbers, or a request failing after
its retries, raises RemoteRMError naming the URL and what came back: the step fails and the run stops (its
checkpoints kept), never a silent zero. The API key comes from the environment variable ``api_key_env`` names (a
Bearer token, never logged). Counters: ``remote_rm/{requests,retries,failures}`` per call.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

from scaletrain.reward.http_service import RetrySettings, ServiceClient, ServiceError, check_service_settings


@dataclass
class RemoteRMSettings(RetrySettings):
    """``reward.remote_rm``: the service and its limits (module docstring)."""

    url: str | None = None  # the scoring endpoint, e.g. http://HOST:PORT/get_reward; null: no remote reward model
    api_key_env: str | None = None  # the environment variable holding the API key (a Bearer token); null: none
    max_concurrent: int = 4  # requests in flight at once
    batch_size: int = 32  # samples per request

    @property
    def enabled(self) -> bool:
        return self.url is not None


def check_remote_rm_settings(settings: RemoteRMSettings) -> None:
    """ValueError naming the ``reward.remote_rm`` key of a bad value."""
    positive = {"max_concurrent": settings.max_concurrent, "batch_size": settings.batch_size}
    check_service_settings("reward.remote_rm", "url", "http://HOST:PORT/get_reward", settings, positive)


class RemoteRMError(ServiceError):
    """A scoring request failed after its retries, or its reply was not one number per sample."""


class RemoteRewardModel:
    """The client: ``score(queries, prompts, labels)`` -> one float per sample (module docstring)."""

    def __init__(self, settings: RemoteRMSettings) -> None:
        if settings.url is None:
            raise ValueError("reward.remote_rm.url is not set")
        self.settings = s = settings
        args = ("the remote reward model", settings.url, "reward.remote_rm", s, s.max_concurrent, s.api_key_env)
        self.service = ServiceClient(*args, error_cls=RemoteRMError)

    def __repr__(self) -> str:  # no key
        return f"RemoteRewardModel({self.service.url!r})"

    def score(self, queries: list[str], prompts: list[str], labels: list[Any]) -> list[float]:
        """Every sample's reward, the samples sent ``batch_size`` at a time, concurrently."""
        return asyncio.run(self._score_all(queries, prompts, labels))

    async def _score_all(self, queries: list[str], prompts: list[str], labels: list[Any]) -> list[float]:
        size = self.settings.batch_size
        chunks = [slice(i, i + size) for i in range(0, len(queries), size)]
        try:
            parts = await asyncio.gather(*(self._score(queries[c], prompts[c], labels[c]) for c in chunks))
        finally:
            await self.service.aclose()  # the client's connections belong to this call's event loop
        return [reward for part in parts for reward in part]

    async def _score(self, queries: list[str], prompts: list[str], labels: list[Any]) -> list[float]:
        body = {"query": queries, "prompts": prompts, "labels": labels}
        reply = await self.service.request("POST", "", body)
        rewards = reply.get("rewards") if isinstance(reply, dict) else reply
        if (
            not isinstance(rewards, list)
            or len(rewards) != len(queries)
            or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) for r in rewards)
        ):
            raise self.service.fail(
                f"answered {reply!r:.200} for {len(queries)} samples: expected 'rewards', one number each"
            )
        return [float(r) for r in rewards]

    def metrics(self) -> dict[str, float]:
        """The counters since the last call (``remote_rm/*``), reset."""
        return self.service.metrics("remote_rm")
