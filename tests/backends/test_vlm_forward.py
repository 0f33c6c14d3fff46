"""A vision-language model's per-token outputs in the engines' forward (backends/hf_model.py + backends/vision.py):
the padded and the packed (remove-padding) forward of a batch with images (and a row without) give each response
token the log-prob and entropy of the row's own unpadded forward in plain transformers (fp32, 1e-4); a generated
vision placeholder token is refused. The fsdp and deepspeed engines on 2 gloo ranks: tests/backends/
test_vlm_engines.py."""

from __future__ import annotations

import pytest
import torch

from backends.config import ModelConfig
from backends.hf_model import build_model, forward_micro_batch
from backends.vision import gather_vision_inputs
from tests.backends.vlm_batch import reference_log_probs, vlm_batch, write_vlm_inputs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    work = tmp_path_factory.mktemp("vlm")
    write_vlm_inputs(work)
    model = build_model(ModelConfig(path=str(work / "vlm"), dtype="float32")).eval()
    return model, vlm_batch(work)


@pytest.mark.parametrize("remove_padding", [False, True])
def test_padded_and_packed_forward_equal_each_rows_own(setup, remove_padding):
    model, batch = setup
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    vision = gather_vision_inputs(batch.non_tensor_batch["multi_modal_inputs"], "cpu")
    assert vision["image_grid_thw"].shape[0] == len(batch) - 1  # the last row has no image
    tensors = {k: batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    with torch.no_grad():
        out = forward_micro_batch(
            model, tensors, ("log_probs", "entropy"), remove_padding=remove_padding, chunk_size=5, vision=vision
        )
        expected = reference_log_probs(model, batch)
    for name in ("log_probs", "entropy"):
        torch.testing.assert_close(out[name], expected[name], atol=1e-4, rtol=0)


def test_a_generated_vision_token_is_refused(setup):
    model, batch = setup
    tensors = {k: batch.batch[k].clone() for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    tensors["responses"][2, 0] = model.config.image_token_id
    vision = gather_vision_inputs(batch.non_tensor_batch["multi_modal_inputs"], "cpu")
    with pytest.raises(ValueError, match=r"responses of rows \[2\] hold the model's image / video pad token"):
        forward_micro_batch(model, tensors, ("log_probs",), vision=vision)


def test_image_tokens_without_their_vision_inputs_are_refused(setup):
    """A prompt whose vision inputs were dropped on the way would run with its image pads read as text."""
    model, batch = setup
    tensors = {k: batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    with pytest.raises(ValueError, match=r"holds 80 image pad tokens but its vision inputs .* give 0"):
        forward_micro_batch(model, tensors, ("log_probs",), vision={})
