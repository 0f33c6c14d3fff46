"""Single-process tests of the shared HF model pieces (backends/hf_model.py): the remove-padding (packed) forward
equals the padded forward, both equal a plain log_softmax reference, and the value / reward heads line up with
the response tokens."""

from __future__ import annotations

import pytest
import torch

from backends.config import ModelConfig
from backends.hf_model import build_model, decoder_layers, forward_micro_batch
from backends.sequence.packing import pack
from tests.backends.tiny import make_batch, save_tiny_qwen2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny_qwen2")), seed=0, initializer_range=0.1)


@pytest.fixture(scope="module")
def batch():
    return make_batch(6, 12, 10, seed=3).batch


def _reference_logprobs(model, b, temperature):
    R = b["responses"].shape[1]
    logits = (
        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits[
            :, -R - 1 : -1
        ]
        / temperature
    )
    logp = torch.log_softmax(logits.float(), -1)
    mask = b["attention_mask"][:, -R:]
    return (
        logp.gather(-1, b["responses"][..., None])[..., 0] * mask,
        -(logp.exp() * logp).sum(-1) * mask,
        (logp.exp() ** 2).sum(-1) * mask,
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_causal_lm_packed_equals_padded_equals_reference(model_dir, batch, attn):
    model = build_model(ModelConfig(path=model_dir, dtype="float32", override_config={"attn_implementation": attn}))
    with torch.no_grad():
        outputs = ("log_probs", "entropy", "sum_pi_squared")
        padded = forward_micro_batch(model, batch, outputs, temperature=0.7)
        packed = forward_micro_batch(model, batch, outputs, remove_padding=True, temperature=0.7, chunk_size=7)
        ref_lp, ref_ent, ref_pi2 = _reference_logprobs(model, batch, 0.7)
    for out in (padded, packed):
        assert out["log_probs"].shape == batch["responses"].shape and out["log_probs"].dtype == torch.float32
        torch.testing.assert_close(out["log_probs"], ref_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(out["entropy"], ref_ent, atol=1e-5, rtol=0)
        torch.testing.assert_close(out["sum_pi_squared"], ref_pi2, atol=1e-6, rtol=1e-5)


def test_packed_gradients_equal_padded(model_dir, batch):
    model = build_model(ModelConfig(path=model_dir, dtype="float32"))
    grads = []
    for remove_padding in (False, True):
        model.zero_grad()
        out = forward_micro_batch(model, batch, ("log_probs",), remove_padding=remove_padding)
        out["log_probs"].sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_pack_layout_and_boundaries(batch):
    ids, pos, index = pack(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    mask = batch["attention_mask"].bool()
    assert ids.shape == (1, int(mask.sum())) and torch.equal(ids[0], batch["input_ids"][mask])
    assert int((pos[0] == 0).sum()) == batch["input_ids"].shape[0]  # one restart per row
    assert torch.equal(ids[0, index[mask]], batch["input_ids"][mask])
    bad = batch["position_ids"] + 1
    with pytest.raises(ValueError):
        pack(batch["input_ids"], batch["attention_mask"], bad)


def test_value_and_reward_heads(model_dir, batch):
    R = batch["responses"].shape[1]
    resp_mask = batch["attention_mask"][:, -R:]
    torch.manual_seed(0)
    critic = build_model(ModelConfig(path=model_dir, dtype="float32", kind="value"))
    assert critic.config.classifier_dropout == 0.0
    torch.manual_seed(0)
    rm = build_model(ModelConfig(path=model_dir, dtype="float32", kind="reward"))
    with torch.no_grad():
        token_values = critic(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits[..., 0]
        for remove_padding in (False, True):
            values = forward_micro_batch(critic, batch, ("values",), "value", remove_padding)["values"]
            torch.testing.assert_close(values, token_values[:, -R - 1 : -1] * resp_mask, atol=1e-5, rtol=0)
            scores = forward_micro_batch(rm, batch, ("scores",), "reward", remove_padding)["scores"]
            assert scores.shape == (batch["input_ids"].shape[0],)
            # each row scored alone, unpadded, at its last token
            for i in range(len(scores)):
                ids = batch["input_ids"][i][batch["attention_mask"][i].bool()][None]
                alone = rm(input_ids=ids).logits[0, 0]
                torch.testing.assert_close(scores[i], alone, atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        forward_micro_batch(critic, batch, ("log_probs",), "value")


def test_build_options(model_dir):
    model = build_model(
        ModelConfig(
            path=model_dir, dtype="bfloat16", enable_gradient_checkpointing=True, override_config={"rms_norm_eps": 1e-5}
        )
    )
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.is_gradient_checkpointing and model.config.rms_norm_eps == 1e-5 and not model.config.use_cache
    assert len(decoder_layers(model)) == 2
    with pytest.raises(ValueError):
        build_model(ModelConfig(path=model_dir, kind="policy"))
