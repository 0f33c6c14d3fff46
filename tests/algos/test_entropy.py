"""Chunked entropy / label log-probs equal the full-softmax versions, values and gradients."""

import pytest
import torch

from scaletrain.algos import entropy_from_logits, logprobs_from_logits


def full_entropy(logits):
    logp = torch.log_softmax(logits.double(), -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 1000])
def test_entropy_matches_full_softmax_with_gradient(chunk_size):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11, generator=gen)).requires_grad_(True)
    weights = torch.randn(3, 5, generator=gen)
    ent = entropy_from_logits(logits, chunk_size=chunk_size)
    assert ent.shape == (3, 5) and ent.dtype == torch.float32
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = full_entropy(ref_logits)
    torch.testing.assert_close(ent.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    (ent * weights).sum().backward()
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad.double(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [1, 6, 1000])
def test_logprobs_match_log_softmax_with_gradient(chunk_size):
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(2, 7, 13, generator=gen)).requires_grad_(True)
    labels = torch.randint(0, 13, (2, 7), generator=gen)
    weights = torch.randn(2, 7, generator=gen)
    lp = logprobs_from_logits(logits, labels, chunk_size=chunk_size)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = torch.log_softmax(ref_logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(lp.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    (lp * weights).sum().backward()
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad.double(), atol=1e-5, rtol=1e-4)


def test_bf16_logits_and_combined_backward():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 9, 17, generator=gen).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 17, (4, 9), generator=gen)
    loss = -logprobs_from_logits(logits, labels, chunk_size=5).mean() - 0.01 * entropy_from_logits(logits, 8).mean()
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16
    ref_logits = logits.detach().float().requires_grad_(True)
    ref_loss = (
        -torch.log_softmax(ref_logits, -1).gather(-1, labels[..., None]).mean()
        - 0.01 * full_entropy(ref_logits).float().mean()
    )
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-4)
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad, atol=1e-3, rtol=2e-2)


def test_argument_checks():
    with pytest.raises(ValueError):
        entropy_from_logits(torch.zeros(2, 3), chunk_size=0)
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
