"""A copy of the embedded tiny model whose trainer-side forward hangs on rank 1 (user model code stuck outside any
collective, loaded with trust_remote_code as a custom architecture would be)."""

import json
import shutil
from pathlib import Path

MODELING = """
import os
import time

import torch
from transformers import Qwen2ForCausalLM


class HangingQwen2ForCausalLM(Qwen2ForCausalLM):
    def forward(self, *args, **kwargs):
        if os.environ.get("RANK") == "1" and not torch.is_grad_enabled():  # the first log-prob pass
            time.sleep(3600)
        return super().forward(*args, **kwargs)
"""


def hanging_model(model_dir: str, out: Path) -> Path:
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_hang.HangingQwen2ForCausalLM"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "modeling_hang.py").write_text(MODELING)
    return out
