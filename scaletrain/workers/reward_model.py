"""RewardModelWorker: a sequence-classification model that scores whole responses (layer 2).

Forward only. Each rank scores its share of the rows with the HF model (one scalar per sequence, read at the
last valid token) and places the score at the last valid response token, the layout reward managers use, as
``rm_scores`` (B, R).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification

from scaletrain.controller import Dispatch, Worker, register
from scaletrain.protocol import DataProto
from scaletrain.workers.config import RewardModelConfig
from scaletrain.workers.dispatch import ENGINE_PROTO

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RewardModelWorker(Worker):
    def __init__(self, config: RewardModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            self.config.model.path, num_labels=1, torch_dtype=_DTYPES[self.config.model.dtype]
        ).to(self.device).eval()
        self.register_mesh("engine", self.rank, self.world_size, True)

    @torch.no_grad()
    def _score(self, mb: DataProto) -> torch.Tensor:
        ids = mb.batch["input_ids"].to(self.device)
        mask = mb.batch["attention_mask"].to(self.device)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=mb.batch["position_ids"].to(self.device)).logits
        return logits.float().reshape(len(mb), -1)[:, 0].cpu()

    @register(dispatch_mode=ENGINE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        size = self.config.micro_batch_size_per_gpu
        scores = torch.cat([self._score(mb) for mb in data.split(size)]) if len(data) else torch.zeros(0)
        responses = data.batch["responses"]
        resp_len = responses.shape[1]
        valid = data.batch["attention_mask"][:, -resp_len:].sum(-1)
        token_scores = torch.zeros(responses.shape, dtype=torch.float32)
        rows = torch.nonzero(valid > 0, as_tuple=True)[0]
        token_scores[rows, valid[rows] - 1] = scores[rows]
        return DataProto.from_dict({"rm_scores": token_scores})
