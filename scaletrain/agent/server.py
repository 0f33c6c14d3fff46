"""The async rollout path's client side: many agent loops share the rollout engines through one batcher.

``AsyncServerManager.generate(request_id, prompt_ids, sampling_params)`` is what agent loops await. Requests
pending at the same time are gathered into one batch and sent as one token-level generate call to the engines
(``EngineBackend.generate``: one request list per rollout DP rank in, one output list per rank out), run in a
thread so tools keep running on the event loop meanwhile. A batch is flushed when every live trajectory is
waiting for tokens (none is running a tool or a simulated user), or ``max_wait_ms`` after its first request.

Routing is sticky: a trajectory's ``request_id`` is bound to one DP rank (the least loaded one) when first seen
and keeps it until ``release(request_id)``, so every turn of a trajectory lands on the same engine (its prefix
cache).

Partial rollout (``segment_tokens``): a long request is generated a segment at a time, so a weight push waiting
between two of the engines' calls goes before the rest (see ``_generate_in_segments``); each request's weight
versions are kept for the manager (``pop_versions``).

Backends: ``AsyncEngineBackend`` (the default on vLLM at TP=1, ``rollout.async_engine``): every request goes at
once to its rank's vLLM AsyncLLM inside the rollout worker (``generate_request``), which batches all requests in
flight continuously, so there is no driver-side batch at all. The batching backends: ``WorkerGroupBackend`` (the
ActorRolloutRefWorker group's ``generate_tokens`` through its typed role, one Ray call per batch covering every
rank: the hf engine, or vLLM at TP>1) and ``LocalEngineBackend`` (RolloutEngine objects in this process: tests,
benchmarks; ``LocalAsyncEngineBackend`` for in-process async engines). See README "Agent loops".
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from backends.rollout.base import SamplingConfig, TokenOutput, TokenRequest
from scaletrain.utils.seeding import derive_seed

if TYPE_CHECKING:
    from typing_extensions import TypeIs

logger = logging.getLogger(__name__)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens", "seed")


class EngineBackend(Protocol):
    """Batched: one ``generate`` call per batch, one request list per DP rank."""

    dp_size: int

    def generate(self, per_rank: list[list[TokenRequest]]) -> list[list[TokenOutput]]: ...


class RequestBackend(Protocol):
    """Per request: each request sent at once to its DP rank's engine (the engines batch them)."""

    dp_size: int

    async def generate_one(self, rank: int, request: TokenRequest) -> TokenOutput: ...


def sends_each_request(backend: EngineBackend | RequestBackend) -> TypeIs[RequestBackend]:
    return hasattr(backend, "generate_one")


class LocalEngineBackend:
    """In-process engines, one per "DP rank" (called one after the other)."""

    def __init__(self, engines: list) -> None:
        self.engines = list(engines)
        self.dp_size = len(self.engines)

    def generate(self, per_rank: list[list[TokenRequest]]) -> list[list[TokenOutput]]:
        return [engine.generate_tokens(reqs) if reqs else [] for engine, reqs in zip(self.engines, per_rank)]


class LocalAsyncEngineBackend:
    """In-process async engines (backends/rollout/vllm_async.py), one per "DP rank": each request is submitted at
    once, as the rollout workers' AsyncEngineBackend does (tests, benchmarks)."""

    def __init__(self, engines: list) -> None:
        self.engines = list(engines)
        self.dp_size = len(self.engines)

    async def generate_one(self, rank: int, request: TokenRequest) -> TokenOutput:
        return await asyncio.wrap_future(self.engines[rank].submit(request))


class TokenRole(Protocol):
    """A typed role whose engines take token requests (the policy's rollout, a generative judge's engines)."""

    def rollout_dp_size(self) -> int: ...

    def generate_tokens(self, per_rank: list[list[TokenRequest]]) -> list[list[TokenOutput]]: ...


class WorkerGroupBackend:
    """A worker group's engines, through its typed role: ``generate_tokens`` with one request list per DP rank."""

    def __init__(self, policy: TokenRole) -> None:
        self.policy = policy
        self.dp_size = policy.rollout_dp_size()

    def generate(self, per_rank: list[list[TokenRequest]]) -> list[list[TokenOutput]]:
        return self.policy.generate_tokens(per_rank)


class AsyncEngineBackend:
    """The rollout workers' async engines (vLLM's AsyncLLM): ``generate_one`` sends one request to rollout engine
    ``rank`` at once, through the typed role (which also stamps the weight version in split placement)."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.dp_size = policy.rollout_dp_size()

    async def generate_one(self, rank: int, request: TokenRequest) -> TokenOutput:
        return await self.policy.generate_request(rank, request)


def to_sampling(params: dict[str, Any]) -> SamplingConfig:
    unknown = set(params) - set(SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling parameters {sorted(unknown)}; known: {', '.join(SAMPLING_FIELDS)}")
    return replace(SamplingConfig(), n=1, **params)


class AsyncServerManager:
    def __init__(
        self, backend: EngineBackend | RequestBackend, max_wait_ms: float = 5.0, segment_tokens: int | None = None
    ) -> None:
        """``segment_tokens``: partial rollout's granularity (null: each request in one call)."""
        self.backend = backend
        self.segment_tokens = segment_tokens
        self.versions: dict[str, list[int | None]] = {}  # request id -> the weight version of each call
        self.max_wait_s = max_wait_ms / 1000.0
        self.routes: dict[str, int] = {}
        self.loads = [0] * backend.dp_size
        self.pending: list[tuple[int, TokenRequest, asyncio.Future]] = []
        self.active = 0
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollout-batch")
        self.reset_stats()

    @property
    def batched(self) -> bool:
        """Whether requests are gathered into batches here (False: the engines batch them, AsyncEngineBackend)."""
        return not sends_each_request(self.backend)

    def reset_stats(self) -> None:
        self.stats = {"batches": 0, "requests": 0, "generate_s": 0.0, "tokens": 0, "partial_rollouts": 0}

    # ------------------------------------------------------------------------------------- trajectories
    def acquire(self, request_id: str) -> int:
        """Bind a trajectory to its DP rank (the least loaded) and count it live; returns the rank."""
        if request_id not in self.routes:
            rank = min(range(len(self.loads)), key=lambda r: (self.loads[r], r))
            self.routes[request_id] = rank
            self.loads[rank] += 1
            self.active += 1
        return self.routes[request_id]

    def release(self, request_id: str) -> None:
        rank = self.routes.pop(request_id, None)
        if rank is not None:
            self.loads[rank] -= 1
            self.active -= 1
            self._poke()  # the trajectories still live may all be waiting now

    # ----------------------------------------------------------------------------------------- generate
    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        multi_modal_inputs: dict[str, Any] | None = None,
    ) -> TokenOutput:
        """One sample continuing ``prompt_ids``; ``multi_modal_inputs``: a vision-language model's inputs for the
        images in them, in order (None: no images)."""
        rank = self.acquire(request_id)
        if not prompt_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        sampling = to_sampling(sampling_params)
        vision = multi_modal_inputs or None
        if self.segment_tokens and sampling.max_new_tokens > self.segment_tokens:
            out = await self._generate_in_segments(rank, list(prompt_ids), sampling, self.segment_tokens, vision)
        else:
            out = await self._submit(rank, TokenRequest(list(prompt_ids), sampling, vision))
        self.versions.setdefault(request_id, []).append(out.weight_version)
        return out

    async def _submit(self, rank: int, request: TokenRequest) -> TokenOutput:
        if sends_each_request(self.backend):  # not batched here
            out = await self.backend.generate_one(rank, request)
            self.stats["requests"] += 1
            self.stats["tokens"] += len(out.token_ids)
            return out
        future = asyncio.get_running_loop().create_future()
        self.pending.append((rank, request, future))
        self._ensure_worker()
        self._poke()
        return await future

    async def _generate_in_segments(
        self,
        rank: int,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        segment_tokens: int,
        vision: dict[str, Any] | None = None,
    ) -> TokenOutput:
        """Partial rollout: ``segment_tokens`` at a time, each segment continuing from the tokens so far. A
        weight push between two segments goes first, and the rest is generated with the new weights; the tokens
        and log-probs already generated are kept. The output's weight_version is the oldest that contributed."""
        tokens: list[int] = []
        log_probs: list[float] = []
        versions: list[int | None] = []
        reason = "length"
        while len(tokens) < sampling.max_new_tokens:
            want = min(segment_tokens, sampling.max_new_tokens - len(tokens))
            seed = sampling.seed if sampling.seed is None or not versions else derive_seed(sampling.seed, len(versions))
            request = TokenRequest(prompt_ids + tokens, replace(sampling, max_new_tokens=want, seed=seed), vision)
            part = await self._submit(rank, request)
            tokens += part.token_ids
            log_probs += part.log_probs
            versions.append(part.weight_version)
            reason = part.finish_reason
            if reason == "stop" or len(part.token_ids) < want:
                break
        known = [v for v in versions if v is not None]
        if known and min(known) != max(known):
            self.stats["partial_rollouts"] += 1
        return TokenOutput(tokens, log_probs, reason, min(known) if known else None)

    def pop_versions(self, request_ids: list[str]) -> list[int | None]:
        """Per trajectory, the oldest weight version among its generation calls (None where unknown)."""
        out = []
        for rid in request_ids:
            known = [v for v in self.versions.pop(rid, []) if v is not None]
            out.append(min(known) if known else None)
        return out

    def _poke(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _ensure_worker(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._serve())

    def _event(self) -> asyncio.Event:
        """The batcher's wake-up event (``_ensure_worker`` makes it before it starts the batcher task)."""
        assert self._wakeup is not None
        return self._wakeup

    async def close(self) -> None:
        """Stop the batcher task of the current event loop (call before the loop ends)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    async def _serve(self) -> None:
        """The batcher task. Whatever ends it (a bug, a bad engine output, cancellation) fails every trajectory
        still waiting with that error instead of leaving it waiting forever."""
        in_flight: list[asyncio.Future] = []
        try:
            while True:
                await self._event().wait()
                self._event().clear()
                if not self.pending:
                    continue
                await self._gather()
                batch, self.pending = self.pending, []
                in_flight = [future for _, _, future in batch]
                await self._flush(batch)
                in_flight = []
                if self.pending:
                    self._event().set()
        except BaseException as exc:
            error = exc if isinstance(exc, Exception) else RuntimeError(f"the rollout batcher stopped ({exc!r})")
            waiting = in_flight + [future for _, _, future in self.pending]
            self.pending = []
            for future in waiting:
                if not future.done():
                    future.set_exception(error)
            if waiting:
                logger.error("rollout batcher failed; %d waiting trajectories get its error: %r", len(waiting), exc)
            raise

    async def _gather(self) -> None:
        """Waits until every live trajectory has a request pending, or ``max_wait_ms`` after the first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        while len(self.pending) < self.active and loop.time() < deadline:
            self._event().clear()
            try:
                await asyncio.wait_for(self._event().wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break

    async def _flush(self, batch: list[tuple[int, TokenRequest, asyncio.Future]]) -> None:
        """One generate call for ``batch``; each future gets its output, or all of them the engine's error."""
        per_rank: list[list[TokenRequest]] = [[] for _ in range(self.backend.dp_size)]
        slots = []
        for rank, request, future in batch:
            slots.append((rank, len(per_rank[rank]), future))
            per_rank[rank].append(request)
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        backend = self.backend
        assert not sends_each_request(backend)  # only a batched backend has a batcher
        try:
            outputs = await loop.run_in_executor(self._executor, backend.generate, per_rank)
        except Exception as exc:  # every waiting trajectory sees the engine's error; the batcher goes on
            for _, _, future in slots:
                if not future.done():
                    future.set_exception(exc)
            return
        got = [len(out) for out in outputs]
        if got != [len(reqs) for reqs in per_rank]:
            raise RuntimeError(f"rollout engines returned {got} outputs per rank for {[len(r) for r in per_rank]}")
        self.stats["batches"] += 1
        self.stats["requests"] += len(batch)
        self.stats["generate_s"] += time.perf_counter() - start
        for rank, pos, future in slots:
            out = outputs[rank][pos]
            self.stats["tokens"] += len(out.token_ids)
            if not future.done():
                future.set_result(out)
