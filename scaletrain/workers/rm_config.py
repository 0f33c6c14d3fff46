"""``reward_model.*`` (layer 2): the reward model's section, which is also its worker's config, discriminative (a
sequence classifier on the training backend, scaletrain/workers/reward_model.py) or generative (a judge served by a
rollout engine, scaletrain/workers/generative_rm.py), and the rule reward's scoring limits."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from backends.config import EngineConfig
from backends.rollout.base import RolloutEngineSettings
from scaletrain.reward.loader import DEFAULT_LOAD_TIMEOUT_S
from scaletrain.workers.config import EngineSetup
from scaletrain.workers.model_sections import RewardModelModelConfig


@dataclass
class GenerativeRolloutConfig(RolloutEngineSettings):
    """``reward_model.rollout``: the engine serving a generative judge (verl's ``reward.reward_model.rollout``); its
    memory and kernel settings come from RolloutEngineSettings. A judge request carries its own sampling (the
    OpenAI chat parameters its reward function sends)."""

    EXECUTION_ONLY = ("tensor_model_parallel_size",)

    name: str | None = None  # vllm | hf: a causal LM at reward_model.model.path is a generative judge served by
    # this engine (a sequence classifier is scored on the training backend all the same); null: no judge engine
    tensor_model_parallel_size: int = 1  # ranks one judge engine spans (> 1: vllm only)
    prompt_length: int = 2048  # tokens of a judge prompt (its chat rendered); a longer one fails its request
    response_length: int = 512  # most tokens of a judge reply (a request's max_tokens is bounded by it)


@dataclass
class RewardModelConfig:
    """``reward_model.*``: verl's section for the reward model and the rule reward's scoring, which is also the
    reward-model worker's config (the worker gets the derived rest as an ``EngineSetup``)."""

    EXECUTION_ONLY = (
        "micro_batch_size_per_gpu",
        "use_dynamic_bsz",
        "forward_max_token_len_per_gpu",
        "ulysses_sequence_parallel_size",
        "timeout_s",
        "load_timeout_s",
        "num_processes",
        "step_timeout_s",
        "max_error_rate",
        "max_error_steps",
    )

    enable: bool = False  # the RM's score replaces the rule reward (verl), or is added to
    # custom_reward_function's score when that is set; see rm_reward.py. With rollout.name set: a generative judge
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    rollout: GenerativeRolloutConfig = field(default_factory=GenerativeRolloutConfig)  # name set: the model is a
    # generative judge served by that rollout engine (scaletrain/workers/generative_rm.py)
    enable_resource_pool: bool = False  # the judge's engines on a pool of their own (n_gpus_per_node x nnodes
    # ranks, never asleep) instead of the actor's ranks (asleep while training); generative judges only
    n_gpus_per_node: int = 1  # with enable_resource_pool: the judge pool's ranks per node ...
    nnodes: int = 1  # ... and its nodes
    micro_batch_size_per_gpu: int = 8  # rows per RM forward on one device
    max_length: int | None = None  # re-tokenized RM inputs keep their last max_length tokens; null: all
    use_dynamic_bsz: bool = False  # micro-batches by tokens (forward_max_token_len_per_gpu) instead
    forward_max_token_len_per_gpu: int = 16384  # valid tokens per RM micro-batch on one device, with use_dynamic_bsz
    ulysses_sequence_parallel_size: int = 1  # fsdp, deepspeed: ranks that split each packed sequence (Ulysses;
    # needs model.use_remove_padding)
    reward_manager: str = "naive"  # naive | prime | batch | dapo | multi
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # more arguments of the reward manager (e.g.
    # dapo's overlong_buffer_cfg, multi's scorers); names it does not take fail before Ray starts
    timeout_s: float | None = 30.0  # seconds one scorer call may take (the sample scores 0, counted as a
    # timeout; the manager's compute_score_timeout); null: no limit
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S  # seconds the reward file's top-level code may take to
    # import (in a thread of its own: the driver fails naming the file, never freezes)
    num_processes: int = 2  # worker processes that run the scorer, in parallel
    step_timeout_s: float | None = 600.0  # seconds the scoring of one step may take; unscored samples get 0
    # and count as timeouts; null: no bound
    max_error_rate: float = 0.5  # more than this share of a step's samples failing (errors + timeouts) ...
    max_error_steps: int = 3  # ... this many steps in a row stops the run, naming the scorer and its traceback

    def engine_config(self, setup: EngineSetup) -> EngineConfig:
        """The RM engine's settings: the setup's, with this section's micro-batching."""
        return replace(
            setup.engine,
            micro_batch_size_per_gpu=self.micro_batch_size_per_gpu,
            use_dynamic_bsz=self.use_dynamic_bsz,
            max_token_len_per_gpu=self.forward_max_token_len_per_gpu,
            ulysses_sequence_parallel_size=self.ulysses_sequence_parallel_size,
        )


def serves_judge(rm: RewardModelConfig) -> bool:
    """Whether the reward model is a generative judge: enabled, ``rollout.name`` set and ``model.path`` a causal LM.
    A sequence classifier is scored on the training backend even with ``rollout.*`` set (verl's examples of
    discriminative reward models set them: verl serves those too)."""
    if not (rm.enable and rm.rollout.name and rm.model.path):
        return False
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(rm.model.path, trust_remote_code=rm.model.trust_remote_code)
    except (OSError, ValueError):
        return False  # no model there: validate_reward_model names the key
    archs = getattr(hf_config, "architectures", None) or []
    return not any(a.endswith("ForSequenceClassification") for a in archs)
