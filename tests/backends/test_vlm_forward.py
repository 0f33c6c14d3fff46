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
from tests.backends.vlm_batch import (
    reference_head_outputs,
    reference_log_probs,
    vlm_batch,
    write_vlm_inputs,
)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("vlm")
    write_vlm_inputs(work)
    return work


@pytest.fixture(scope="module")
def setup(work):
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


@pytest.mark.parametrize("kind", ["value", "reward"])
def test_a_vlm_critics_values_and_a_vlm_reward_models_scores_equal_each_rows_own(setup, work, kind):
    """The critic and the reward model of a VLM run read the images too: transformers ships no Qwen2-VL classifier,
    backends.vision.head_model_class puts its generic token / sequence head over the VLM backbone."""
    _, batch = setup
    model = build_model(ModelConfig(path=str(work / f"vlm_{kind}"), kind=kind, dtype="float32")).eval()
    assert type(model).__name__ == f"Qwen2_5_VLFor{'Token' if kind == 'value' else 'Sequence'}Classification"
    vision = gather_vision_inputs(batch.non_tensor_batch["multi_modal_inputs"], "cpu")
    tensors = {k: batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    name = {"value": "values", "reward": "scores"}[kind]
    with torch.no_grad():
        expected = reference_head_outputs(model, batch)[name]
        for remove_padding in (False, True):
            out = forward_micro_batch(model, tensors, (name,), kind=kind, remove_padding=remove_padding, vision=vision)
            torch.testing.assert_close(out[name], expected, atol=1e-4, rtol=0)
        # the images count: the same rows with each image blanked score otherwise
        blank = {**vision, "pixel_values": torch.zeros_like(vision["pixel_values"])}
        other = forward_micro_batch(model, tensors, (name,), kind=kind, vision=blank)[name]
    assert float((other - expected).abs().max()) > 1e-3


def test_a_text_model_given_images_is_refused(setup, tmp_path):
    """A text critic or reward model on a VLM's rows would read the image placeholders as text, silently."""
    from tests.backends.tiny import save_tiny_reward_model

    _, batch = setup
    model = build_model(ModelConfig(path=save_tiny_reward_model(str(tmp_path / "rm")), kind="reward", dtype="float32"))
    tensors = {k: batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    vision = gather_vision_inputs(batch.non_tensor_batch["multi_modal_inputs"], "cpu")
    with pytest.raises(ValueError, match=r"carries images .* this reward model is a text model"):
        forward_micro_batch(model, tensors, ("scores",), kind="reward", vision=vision)
