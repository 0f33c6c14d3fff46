"""vLLM's AsyncLLM behind the RolloutEngine interface: continuous batching for the agent loops (layer 1).

The agent loops' requests reach a rollout worker one at a time, from many trajectories and turns at once
(``submit``); AsyncLLM schedules every request in flight into the same engine steps, so a trajectory that
finishes a turn, runs a tool and comes back joins the running batch instead of waiting for a driver-side flush.
Its engine core runs in a process of its own (AsyncLLM always does); with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
(set for every vLLM engine here) the model runs inside that process, with no further worker process.

- Calls come from any thread: AsyncLLM lives on an event loop in a thread of its own (``_loop``); ``submit``
  hands a request to it and returns a concurrent Future, the blocking methods (``generate``, ``generate_tokens``,
  weights, sleep) wait for their coroutine there.
- Sampling, seeds and log-probs are those of the synchronous engine (vllm_engine.py: ``token_params``,
  ``requests``): a seeded request samples the same tokens in either engine.
- Weights: buckets go to the engine-core process through two reused slots (ipc_transport.py: shared memory, or
  CUDA IPC by name; safetensors files with ``checkpoint_engine.backend=naive``), then the prefix cache is reset.
  The caller makes sure no request is in flight meanwhile (the trainer's rollout phases and RolloutRole's turns
  do). A LoRA adapter goes as a directory there
  too (vllm_lora.py), which every request names.
- The engine-core process watches this one (``scaletrain_watch_parent`` in vllm_extension.py) and exits when it
  is gone, so a killed rollout worker leaves no engine behind.
- Tensor parallelism is not supported here (the TP ranks are the trainer's SPMD ranks, vllm_tp.py): TP > 1 keeps
  the synchronous engine and the driver-side batcher (config check ``rollout.async_engine``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
from typing import Any

from backends.rollout.base import WAKE_TAGS, RolloutConfig, TokenOutput, TokenRequest, register_rollout
from backends.rollout.vllm_engine import VLLMRolloutEngine, import_vllm, refuse_images, start_vllm
from scaletrain.utils.gc_tuning import settle

logger = logging.getLogger(__name__)


@register_rollout("vllm_async")
class VLLMAsyncRolloutEngine(VLLMRolloutEngine):
    llm: Any  # vLLM's AsyncLLM (vLLM is imported lazily); None once closed

    def __init__(self, config: RolloutConfig, tokenizer, **engine_kwargs):
        """``engine_kwargs``: extra AsyncEngineArgs (they override the defaults)."""
        if config.tensor_parallel_size != 1:
            raise ValueError(
                f"the vLLM async engine runs at tensor_parallel_size=1 (got {config.tensor_parallel_size}); "
                "use the synchronous engine (the rollout's async_engine=false)"
            )
        self._init_common(config, tokenizer)
        self.in_process, self.tp_rank, self.spmd_seeds = False, 0, None  # the model runs in the engine core
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-async-engine", daemon=True)
        self._thread.start()
        import_vllm()
        try:
            self.llm, self.sleep_supported = start_vllm(config, self._build, "vLLM async engine", engine_kwargs)
        except Exception:
            self.close()
            raise
        self.rpc("scaletrain_watch_parent", os.getpid())

    def _build(self, kwargs: dict[str, Any], device: str):
        """AsyncLLM, made on the engine's loop (its output tasks live there)."""
        return self._wait(self._start(kwargs))

    async def _start(self, kwargs: dict[str, Any]):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        settle()  # vLLM's start-up collects several times: what exists now (its modules too) is left out
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    def _wait(self, coroutine):
        """Run ``coroutine`` on the engine's loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    # ------------------------------------------------------------------------------------------------ generate
    def submit(self, request: TokenRequest) -> concurrent.futures.Future:
        """Start one agent-loop request now, alongside those in flight; the Future's result is its TokenOutput."""
        from vllm.inputs import TokensPrompt

        refuse_images([request])
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
        return asyncio.run_coroutine_threadsafe(self._token(prompt, self.token_params(request.sampling)), self._loop)

    async def _token(self, prompt, params) -> TokenOutput:
        return self.token_output(await self._raw(prompt, params))

    def run_requests(self, prompts: list, params: list) -> list:
        """RequestOutputs in order: every request submitted at once (the batched generate and generate_tokens)."""

        async def run_all() -> list:
            return await asyncio.gather(*(self._raw(prompt, p) for prompt, p in zip(prompts, params)))

        return self._wait(run_all()) if prompts else []

    async def _raw(self, prompt, params) -> Any:
        """One request's final RequestOutput (AsyncLLM streams; only the last output is kept)."""
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY
        final = None
        request_id, lora = f"req-{next(self._ids)}", self.lora_request()
        async for out in self.llm.generate(prompt, params, request_id=request_id, lora_request=lora):
            final = out
        return final

    def generate_tokens(self, requests: list[TokenRequest]) -> list[TokenOutput]:
        return [future.result() for future in [self.submit(r) for r in requests]]

    # ------------------------------------------------------------------------------------------ weights, memory
    def rpc(self, method: str, *args) -> list:
        return self._wait(self.llm.collective_rpc(method, args=args))

    def rpc_started(self, method: str, *args) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(self.llm.collective_rpc(method, args=args), self._loop)

    def reset_prefix_cache(self) -> None:
        self._wait(self.llm.reset_prefix_cache())

    def sleep(self) -> None:
        if self.sleep_supported:
            self._wait(self.llm.sleep(level=1))

    def wake_up(self, tags: tuple[str, ...] = WAKE_TAGS) -> None:
        if self.sleep_supported:
            self._wait(self.llm.wake_up(tags=list(tags)))

    def close(self) -> None:
        """Stop the engine-core process and the loop thread (also done when this process exits)."""
        llm, self.llm = getattr(self, "llm", None), None
        if getattr(self, "slots", None) is not None:
            self.slots.close()  # pyright: ignore[reportOptionalMemberAccess]
        if llm is not None:
            self._wait(self._shutdown(llm))
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)

    async def _shutdown(self, llm) -> None:
        """On the loop: AsyncLLM's shutdown, then its output tasks cancelled and awaited (so none is left pending)."""
        llm.shutdown()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
