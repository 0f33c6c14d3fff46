"""RewardModelWorker: a sequence-classification model that scores whole responses (layer 2).

Forward only: one TrainEngine of kind ``reward`` (no optimizer) built by the configured backend (fsdp, deepspeed,
megatron). Each rank scores its share of the rows (one scalar per sequence, read at its last valid token) and the
worker places the score at the last valid response token, the layout reward managers use, as ``rm_scores`` (B, R).
The RM reads the policy's tokens, or, with ``input_tokenizer`` set, the rollout re-tokenized with its own tokenizer
and chat template (scaletrain/workers/rm_inputs.py); micro-batches follow ``micro_batch_size_per_gpu`` (or
``forward_max_token_len_per_gpu`` tokens with ``use_dynamic_bsz``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from backends.base import TrainEngine, get_backend
from scaletrain.controller import Dispatch, Worker, register
from scaletrain.protocol import DataProto
from scaletrain.workers.config import EngineSetup
from scaletrain.workers.dispatch import ENGINE_PROTO, declare_engine_mesh
from scaletrain.workers.rm_config import RewardModelConfig
from scaletrain.workers.rm_inputs import policy_inputs, retokenized_inputs

logger = logging.getLogger(__name__)


def place_at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence scores -> (B, R) token scores, each at its row's last valid response token."""
    token_scores = torch.zeros(response_mask.shape, dtype=torch.float32)
    valid = response_mask.sum(-1)
    rows = torch.nonzero(valid > 0, as_tuple=True)[0]
    token_scores[rows, valid[rows] - 1] = scores[rows].float()
    return token_scores


class RewardModelWorker(Worker):
    def __init__(self, config: RewardModelConfig, setup: EngineSetup) -> None:
        """``config``: the ``reward_model.*`` section; ``setup``: the engine's model, backend and settings the
        trainer derived for it."""
        super().__init__()
        self.config = config
        self.setup = setup
        self.engine: TrainEngine | None = None
        self.tokenizers: tuple[Any, Any] | None = None  # (the policy's, the RM's) when re-tokenizing

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        cfg, setup = self.config, self.setup
        model = replace(setup.model, kind="reward")
        self.engine = get_backend(setup.backend)(model, None, cfg.engine_config(setup))
        declare_engine_mesh(self, self.engine)
        if cfg.model.input_tokenizer:
            from transformers import AutoTokenizer

            policy_tokenizer, rm_tokenizer = (
                AutoTokenizer.from_pretrained(path, trust_remote_code=model.trust_remote_code)
                for path in (cfg.model.input_tokenizer, model.path)
            )
            self.tokenizers = (policy_tokenizer, rm_tokenizer)

    @register(dispatch_mode=ENGINE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        resp_len = data.tensors["responses"].shape[1]
        if self.tokenizers is None:
            inputs = policy_inputs(data)
        else:
            inputs, truncated = retokenized_inputs(data, *self.tokenizers, self.config.max_length)
            if truncated:
                logger.warning(
                    "reward model: %d of %d re-tokenized rows were longer than reward_model.max_length=%s "
                    "and keep only their last tokens",
                    truncated,
                    len(data),
                    self.config.max_length,
                )
        if self.engine is None:
            raise RuntimeError("RewardModelWorker: call init_model first")
        scores = self.engine.forward(inputs, outputs=("scores",)).tensors["scores"]
        response_mask = data.tensors["attention_mask"][:, -resp_len:]
        return DataProto.from_dict({"rm_scores": place_at_last_token(scores, response_mask)})
