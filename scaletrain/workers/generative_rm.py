"""GenerativeRewardModelWorker: a generative judge served by a rollout engine of the run's own (layer 2).

``reward_model.rollout.name`` (vllm | hf) names the engine and ``reward_model.model.path`` the judge model (a causal
LM). The engine never trains and takes no weights: it answers token-level requests (``generate_tokens``, one
request list per judge engine, the layout of the agent loops' batcher), which the driver's judge server
(scaletrain/trainer/rollout/judge_server.py) sends for the chat requests of the user's reward function.

Colocated with the actor's ranks (the default) the engine is built asleep and sleeps whenever training runs: the
trainer calls ``release`` before the step's training-side calls; the first request after that wakes it (weights,
then KV cache: backends/rollout/lifecycle.py's order). On a pool of its own (``enable_resource_pool``) it is
built with ``free_cache_engine`` off and stays awake.
"""

from __future__ import annotations

from dataclasses import replace

from backends.rollout.base import TokenOutput, TokenRequest
from scaletrain.controller import Dispatch, Worker, register
from scaletrain.workers.colocated_rollout import ColocatedRollout
from scaletrain.workers.dispatch import ROLLOUT_TOKENS
from scaletrain.workers.rm_config import RewardModelConfig
from scaletrain.workers.rollout_setup import build_rollout


class GenerativeRewardModelWorker(Worker):
    def __init__(self, config: RewardModelConfig, trust_remote_code: bool = False) -> None:
        """``config``: the ``reward_model.*`` section (``rollout.name`` set)."""
        super().__init__()
        self.config = config
        self.trust_remote_code = trust_remote_code
        self.rollout: ColocatedRollout | None = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        cfg = self.config
        rc = cfg.rollout
        if cfg.enable_resource_pool:  # nothing trains on its pool: awake from start to end
            rc = replace(rc, free_cache_engine=False)
        assert (
            rc.name is not None and cfg.model.path is not None
        )  # checked before Ray (scaletrain/trainer/rollout/reward_checks.py)
        engine, _ = build_rollout(
            self,
            rc.name,
            cfg.model.path,
            rc,
            tensor_parallel_size=rc.tensor_model_parallel_size,
            max_model_len=rc.prompt_length + rc.response_length,
            trust_remote_code=self.trust_remote_code,
        )
        self.rollout = ColocatedRollout(
            engine, None, free_cache_engine=rc.free_cache_engine, offload_trainer=False, bucket_bytes=0
        )
        self.rollout.release()

    def _need(self) -> ColocatedRollout:
        if self.rollout is None:
            raise RuntimeError("GenerativeRewardModelWorker: call init_model first")
        return self.rollout

    @register(dispatch_mode=ROLLOUT_TOKENS)
    def generate_tokens(self, requests: list[TokenRequest]) -> list[TokenOutput]:
        """The replies to one engine's judge requests (the engine woken first if it sleeps)."""
        if not requests:
            return []
        return self._need().generate_tokens(requests)

    @register(Dispatch.ONE_TO_ALL)
    def release(self) -> None:
        """Training runs now: the engine asleep (``free_cache_engine``) until the next request."""
        self._need().release()

    @register(Dispatch.ONE_TO_ALL)
    def engine_state(self) -> str:
        """The engine's lifecycle state (asleep, weights, serving), for tests and logs."""
        return self._need().lifecycle.state.value
