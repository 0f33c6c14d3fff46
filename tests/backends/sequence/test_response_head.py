"""The LM head fused with the log-probs and entropy (backends/sequence/response_head.py) against the logits path: the
same outputs, loss and gradients of every parameter, packed and padded, at a temperature, chunked (fp32: <= 1e-6 of each
tensor's scale, the two paths rounding differently; fp64 against plain autograd: <= 1e-10), with a head bias; and
where the fusion does not apply, the logits path is taken."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backends.config import ModelConfig
from backends.hf_model import build_model, forward_micro_batch
from backends.sequence.response_head import fused_response_head, head_log_probs, supports_fused_head
from tests.backends.tiny import make_batch, save_tiny_qwen2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny_qwen2")), seed=0, initializer_range=0.1)


def _outputs_and_grads(model, batch, remove_padding, temperature, fused, chunk_size):
    model.zero_grad(set_to_none=True)
    out = forward_micro_batch(
        model,
        batch,
        ("log_probs", "entropy"),
        remove_padding=remove_padding,
        temperature=temperature,
        chunk_size=chunk_size,
        fused_head=fused,
    )
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(out[k].shape, generator=g) for k in ("log_probs", "entropy")]
    loss = (out["log_probs"] * weights[0]).sum() + (out["entropy"] * weights[1]).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in out.items()}, loss.detach(), grads


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_head_equals_the_logits_path(model_dir, remove_padding, temperature):
    model = build_model(ModelConfig(path=model_dir, dtype="float32"))
    batch = make_batch(5, 9, 8, seed=4).batch
    chunk = 7  # several chunks, the last one short
    fused = _outputs_and_grads(model, batch, remove_padding, temperature, True, chunk)
    plain = _outputs_and_grads(model, batch, remove_padding, temperature, False, chunk)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(fused[0][key], plain[0][key], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-6, atol=1e-6)
    assert sorted(fused[2]) == sorted(plain[2])
    for name, grad in plain[2].items():
        scale = grad.abs().max().item()
        assert (fused[2][name] - grad).abs().max().item() <= 1e-6 * scale, name


def test_fused_head_is_exact_in_float64(model_dir):
    """Both fp32 paths round; in float64 the fused one equals plain autograd through full logits."""
    model = build_model(ModelConfig(path=model_dir, dtype="float32")).to(torch.float64)
    batch = make_batch(5, 9, 8, seed=4).batch
    R = batch["responses"].shape[1]

    def plain_autograd(*_args, **_kwargs):
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        logp = torch.log_softmax(model(**inputs).logits[:, -R - 1 : -1] / 0.7, -1)
        mask = batch["attention_mask"][:, -R:]
        entropy = -(logp.exp() * logp).sum(-1) * mask
        return {"log_probs": logp.gather(-1, batch["responses"][..., None])[..., 0] * mask, "entropy": entropy}

    fused = _outputs_and_grads(model, batch, True, 0.7, True, 7)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tests.backends.sequence.test_response_head.forward_micro_batch", plain_autograd)
        reference = _outputs_and_grads(model, batch, True, 0.7, True, 7)
    torch.testing.assert_close(fused[1], reference[1], rtol=1e-12, atol=1e-10)
    for name, grad in reference[2].items():
        torch.testing.assert_close(fused[2][name], grad, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_the_fused_function_with_a_head_bias_matches_autograd():
    torch.manual_seed(0)
    hidden = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    head = nn.Linear(6, 23, bias=True).double()
    labels = torch.randint(0, 23, (11,))
    out = head_log_probs(hidden, head.weight, head.bias, labels, 0.5, 4, True)
    logp = torch.log_softmax(head(hidden) / 0.5, -1)
    expected = torch.stack([logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)], -1)
    torch.testing.assert_close(out, expected)
    torch.autograd.gradcheck(
        lambda h, w, b: head_log_probs(h, w, b, labels, 0.5, 4, True), (hidden, head.weight, head.bias)
    )


def test_where_the_fusion_does_not_apply_the_logits_path_runs(model_dir, monkeypatch):
    model = build_model(ModelConfig(path=model_dir, dtype="float32"))
    config, batch = model.config, make_batch(2, 6, 4, seed=1).batch
    assert supports_fused_head(model, config, ("log_probs", "entropy"))
    with pytest.raises(ValueError, match="the head got 10 positions for 2 labels"):  # (2 rows x R + 1) positions
        with fused_response_head(model, batch["responses"][:, 0], 1.0, False):
            forward_micro_batch(model, batch, ("log_probs",), fused_head=False)
    assert "forward" not in vars(model.lm_head)  # the head's own forward is back

    def not_here(*args, **kwargs):
        raise AssertionError("the fused head ran")

    monkeypatch.setattr("backends.hf_model.fused_response_head", not_here)
    assert not supports_fused_head(model, config, ("log_probs", "sum_pi_squared"))  # no fused sum of p^2
    forward_micro_batch(model, batch, ("log_probs", "sum_pi_squared"))
    config.final_logit_softcapping = 30.0  # the logits rescaled after the head (Gemma 2)
    assert not supports_fused_head(model, config, ("log_probs",))
    forward_micro_batch(model, batch, ("log_probs",))
