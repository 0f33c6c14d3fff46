"""The HF rollout engine with a vision-language model (backends/rollout/hf.py): it generates from the prompts'
images, never samples a vision special token, and its log-probs of the sampled tokens equal the trainer's forward
on the same weights (backends/hf_model.py; the figure: max abs difference <= 1e-4 in fp32)."""

from __future__ import annotations

import pytest
import torch

from backends.config import ModelConfig
from backends.hf_model import build_model, forward_micro_batch
from backends.rollout.base import RolloutConfig, SamplingConfig
from backends.rollout.hf import HFRolloutEngine
from backends.vision import MULTI_MODAL_INPUTS, gather_vision_inputs, vision_special_tokens
from tests.backends.vlm_batch import vlm_batch, write_vlm_inputs


def test_rollout_from_images_and_its_log_probs_equal_the_trainers(tmp_path):
    from scaletrain.models.processor import load_processor

    write_vlm_inputs(tmp_path)
    model_dir = str(tmp_path / "vlm")
    tokenizer = load_processor(model_dir).tokenizer
    prompts = vlm_batch(tmp_path)
    response_len = prompts.batch["responses"].shape[1]
    prompt_len = prompts.batch["input_ids"].shape[1] - response_len
    prompts = prompts.select(batch_keys=["input_ids", "attention_mask", "position_ids"])
    prompts.batch = prompts.batch.apply(lambda t: t[:, :prompt_len])  # the prompts alone
    engine = HFRolloutEngine(RolloutConfig(model_path=model_dir, dtype="float32"), tokenizer)
    out = engine.generate(prompts, SamplingConfig(n=3, temperature=1.0, max_new_tokens=12, seed=7))
    assert len(out) == 3 * len(prompts) and len(out.non_tensor_batch[MULTI_MODAL_INPUTS]) == len(out)
    valid = out.batch["response_mask"].bool()
    special = torch.tensor(vision_special_tokens(engine.model.config))
    assert not bool(torch.isin(out.batch["responses"][valid], special).any())
    model = build_model(ModelConfig(path=model_dir, dtype="float32")).eval()
    vision = gather_vision_inputs(out.non_tensor_batch[MULTI_MODAL_INPUTS], "cpu")
    tensors = {k: out.batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    with torch.no_grad():
        trainer = forward_micro_batch(model, tensors, ("log_probs",), vision=vision)["log_probs"]
    diff = (trainer - out.batch["rollout_log_probs"])[valid].abs().max().item()
    print(f"rollout vs trainer log-probs: max abs diff {diff:.2e}")
    assert diff <= 1e-4, diff
    # the images matter: the same prompts with another row's pixels give other log-probs
    shuffled = list(out.non_tensor_batch[MULTI_MODAL_INPUTS])
    shuffled = shuffled[3:15] + shuffled[:3] + shuffled[15:]  # rows 0-4 hold one image each
    with torch.no_grad():
        other = forward_micro_batch(model, tensors, ("log_probs",), vision=gather_vision_inputs(shuffled, "cpu"))
    assert (other["log_probs"] - trainer)[valid].abs().max().item() > 1e-3
    # prompts whose vision inputs were dropped are refused, not generated from their image pads as text
    without = prompts.select(batch_keys=["input_ids", "attention_mask", "position_ids"], non_tensor_batch_keys=[])
    with pytest.raises(ValueError, match=r"image pad tokens but its vision inputs \(multi_modal_inputs\) give 0"):
        engine.generate(without, SamplingConfig(n=1, temperature=1.0, max_new_tokens=2, seed=7))
