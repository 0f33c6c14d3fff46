"""Discounted scans against step-by-step loops; the generic Registry; masked statistics."""

import pytest
import torch

from scaletrain.algos import (
    discounted_suffix_sum,
    masked_mean,
    masked_var,
    masked_whiten,
)
from scaletrain.utils.registry import Registry


def loop_suffix(x, f):
    B, T = x.shape
    y = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            running = x[b, t].item() + f * running
            y[b, t] = running
    return y


@pytest.mark.parametrize("T", [1, 5, 64, 65, 300])
@pytest.mark.parametrize("f", [0.0, 0.5, 0.97, 1.0])
def test_discounted_suffix_sum(T, f):
    x = torch.randn(3, T, generator=torch.Generator().manual_seed(T))
    for chunk in (1, 8, 64):
        torch.testing.assert_close(
            discounted_suffix_sum(x, f, chunk_size=chunk).double(), loop_suffix(x, f), atol=1e-4, rtol=1e-5
        )


def test_discounted_suffix_sum_long_and_batched_shapes():
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for f in (0.9, 0.999, 1.0):
        y = discounted_suffix_sum(x, f)
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y, loop_suffix(x, f), atol=1e-9, rtol=1e-9)
    x3 = torch.randn(2, 3, 10)
    torch.testing.assert_close(
        discounted_suffix_sum(x3, 0.9), discounted_suffix_sum(x3.reshape(6, 10), 0.9).reshape(2, 3, 10)
    )
    with pytest.raises(ValueError):
        discounted_suffix_sum(x3, 1.5)


def test_masked_stats():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = (torch.rand(3, 5, generator=gen) > 0.4).double()
    vals = x[mask.bool()]
    assert masked_mean(x, mask).item() == pytest.approx(vals.mean().item())
    assert masked_var(x, mask).item() == pytest.approx(vals.var(unbiased=True).item())
    torch.testing.assert_close(
        masked_mean(x, mask, dim=-1)[mask.sum(-1) > 0],
        torch.stack([x[b][mask[b].bool()].mean() for b in range(3) if mask[b].sum() > 0]),
    )
    w = masked_whiten(x, mask)
    assert w[mask.bool()].mean().item() == pytest.approx(0.0, abs=1e-7)
    w2 = masked_whiten(x, mask, shift_mean=False)
    assert w2[mask.bool()].mean().item() == pytest.approx(vals.mean().item())
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, torch.zeros_like(mask))


def test_registry():
    reg = Registry("widget")

    @reg.register("a")
    def a():
        return "A"

    reg.register("b")(len)
    assert reg.get("a") is a and reg.names() == ["a", "b"] and "a" in reg and len(reg) == 2
    reg.register("a")(a)  # same object again: fine
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(len)
    reg.register("a", override=True)(len)
    assert reg.get("a") is len
    with pytest.raises(ValueError) as err:
        reg.get("zzz")
    assert "unknown widget 'zzz'" in str(err.value) and "a, b" in str(err.value)
    with pytest.raises(TypeError):
        reg.get(3)
