"""Single-process unit tests of micro-batch partitioning (backends/batching.py), micro-batch weighting
(backends/accumulation.py), the LR schedule (backends/optim.py) and the backend registry, as the FSDP engine uses
them."""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch

from backends.accumulation import Accumulation
from backends.batching import (
    balanced_partition,
    fixed_partition,
    restore_order,
    token_budget_partition,
)
from backends.config import OptimConfig
from backends.optim import build_lr_scheduler, build_optimizer, lr_multiplier, warmup_steps
from scaletrain.algos import ENGINE_AGG_MODES, agg_count, agg_loss
from scaletrain.protocol import DataProto
from scaletrain.workers.losses import aggregated


def _is_partition(parts, n):
    flat = sorted(i for p in parts for i in p)
    return flat == list(range(n)) and all(p == sorted(p) and p for p in parts)


def test_fixed_partition():
    assert fixed_partition(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert fixed_partition(4, 4) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError):
        fixed_partition(4, 0)


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_respected_and_balanced(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(5, 100) for _ in range(37)]
    budget = 200
    parts = token_budget_partition(lengths, budget)
    assert _is_partition(parts, len(lengths))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) <= budget
    assert len(parts) <= math.ceil(sum(lengths) / budget) + 2  # close to the lower bound
    # more parts on request, still within the budget
    more = token_budget_partition(lengths, budget, min_parts=len(parts) + 3)
    assert len(more) >= len(parts) + 3 and _is_partition(more, len(lengths))
    assert max(sum(lengths[i] for i in p) for p in more) <= budget


def test_balanced_partition_exact_count_and_balance():
    lengths = [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
    parts = balanced_partition(lengths, 3)
    assert len(parts) == 3 and _is_partition(parts, 10)
    loads = sorted(sum(lengths[i] for i in p) for p in parts)
    assert loads[-1] - loads[0] <= 2
    with pytest.raises(ValueError):
        balanced_partition(lengths, 11)


def test_oversized_row_is_alone_with_warning(caplog):
    lengths = [50, 300, 60, 70]
    with caplog.at_level(logging.WARNING, logger="backends.batching"):
        parts = token_budget_partition(lengths, 128)
    assert [1] in parts and "longer than" in caplog.text
    assert all(len(p) == 1 or sum(lengths[i] for i in p) <= 128 for p in parts)
    with pytest.raises(ValueError):
        token_budget_partition(lengths, 128, min_parts=5)


def test_restore_order():
    lengths = [3, 17, 5, 11, 2, 8, 13]
    parts = token_budget_partition(lengths, 20)
    rows = torch.arange(len(lengths)) * 10
    per_part = [rows[p] for p in parts]  # what a forward would return per micro-batch
    assert torch.equal(torch.cat(per_part)[restore_order(parts)], rows)


def _agg_batch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 7, (9,), generator=g)
    mask = (torch.arange(6)[None, :] < lengths[:, None]).float()
    mask[4] = 0  # a row without response tokens: seq-mean modes do not count it
    return DataProto.from_dict({"response_mask": mask, "x": torch.rand(9, 6, generator=g)}), lengths.tolist()


@pytest.mark.parametrize("mode", ENGINE_AGG_MODES)
def test_accumulation_is_partition_invariant(mode):
    """Micro-batch aggregates weighted as the engines weight them (backends/accumulation.py, one process) sum to
    the whole mini-batch's aggregate for any partition; metrics are weighted the same way (a constant stays)."""
    data, lengths = _agg_batch()
    whole = agg_loss(data.batch["x"], data.batch["response_mask"], mode)

    @aggregated(mode)
    def loss_fn(_, mb):
        return agg_loss(mb.batch["x"], mb.batch["response_mask"], mode), {"const": 2.0}

    for parts in (
        fixed_partition(9, 2),
        fixed_partition(9, 4),
        fixed_partition(9, 9),
        token_budget_partition(lengths, 8),
    ):
        micros = [data.select_idxs(p) for p in parts]
        acc = Accumulation(loss_fn, micros, torch.device("cpu"))
        total = 0.0
        for i, micro in enumerate(micros):
            loss, metrics = loss_fn(None, micro)
            total = total + loss * acc.grad_scale(i)
            acc.add(i, loss, metrics)
        assert torch.allclose(total, whole, rtol=1e-6), (mode, parts)
        assert math.isclose(acc.metrics()["loss"], float(whole), rel_tol=1e-6)
        assert math.isclose(acc.metrics()["const"], 2.0, rel_tol=1e-12)
    if mode != "seq-mean-token-sum-norm":  # the former row-share weighting is not exact here
        micros = [data.select_idxs([i]) for i in range(9)]
        assert not torch.isclose(sum(loss_fn(None, m)[0] for m in micros) / 9, whole, rtol=1e-3)


def test_accumulation_defaults_to_row_shares():
    data, _ = _agg_batch()
    micros = [data.select_idxs(p) for p in fixed_partition(9, 4)]
    assert Accumulation(lambda out, mb: None, micros, torch.device("cpu")).weights == [4 / 9, 4 / 9, 1 / 9]
    empty = data.select_idxs([4, 4, 4])  # no unit in the whole mini-batch: row shares, so metrics stay finite
    token_mean = aggregated("token-mean")(lambda out, mb: None)
    acc = Accumulation(token_mean, [empty.select_idxs([0]), empty.select_idxs([1, 2])], torch.device("cpu"))
    assert acc.weights == [1 / 3, 2 / 3]
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        agg_count(data.batch["response_mask"], "token-sum-bogus")
    with pytest.raises(ValueError, match="token-sum"):  # a sum: accumulation would average it
        agg_count(data.batch["response_mask"], "token-sum")


def test_worker_losses_declare_their_units():
    """The actor, critic and SFT losses tell the engines the units of their loss_agg_mode (an empty row is no
    sequence), so all three are weighted exactly."""
    from scaletrain.workers.config import ActorConfig, CriticConfig
    from scaletrain.workers.losses import actor_loss_fn, critic_loss_fn
    from scaletrain.workers.sft import sft_loss_fn

    data, lengths = _agg_batch()
    tokens = float(sum(lengths) - lengths[4])
    assert sft_loss_fn.count(data) == actor_loss_fn(ActorConfig()).count(data) == tokens
    assert actor_loss_fn(ActorConfig(loss_agg_mode="seq-mean-token-mean")).count(data) == 8.0
    critic = CriticConfig(loss_agg_mode="seq-mean-token-sum-norm")
    assert critic_loss_fn(critic).count(data) == 8.0  # as verl: sequences with a token, over a constant length


def test_lr_multiplier_warmup_constant_cosine():
    assert [lr_multiplier(s, 4, 0, "constant", 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = [lr_multiplier(s, 2, 12, "cosine", 0.1) for s in range(14)]
    assert cos[:3] == [0.5, 1.0, 1.0]
    assert all(a >= b for a, b in zip(cos[2:], cos[3:]))  # non-increasing after warm-up
    assert math.isclose(cos[7], 0.1 + 0.9 * 0.5) and math.isclose(cos[12], 0.1) and math.isclose(cos[13], 0.1)
    with pytest.raises(ValueError):
        lr_multiplier(0, 0, 0, "linear", 0.0)


def test_warmup_steps_take_verls_ratio_when_unset():
    """One rule for every engine's schedule (the megatron engine sets its lr from it too)."""
    assert warmup_steps(OptimConfig(warmup_steps=3, lr_warmup_steps_ratio=0.5, total_steps=10)) == 3
    assert warmup_steps(OptimConfig(lr_warmup_steps_ratio=0.25, total_steps=10)) == 2
    with pytest.raises(ValueError, match="needs optim.total_steps"):
        warmup_steps(OptimConfig(lr_warmup_steps_ratio=0.25))


def test_lr_scheduler_drives_optimizer_and_resumes():
    p = torch.nn.Parameter(torch.zeros(2))
    cfg = OptimConfig(lr=0.1, warmup_steps=2, total_steps=6, lr_scheduler="cosine", min_lr_ratio=0.0)
    opt = build_optimizer([p], cfg)
    sched = build_lr_scheduler(opt, cfg)
    seen = []
    for _ in range(4):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.1 * 0.5 * (1 + math.cos(math.pi / 4))])
    state = sched.state_dict()
    sched2 = build_lr_scheduler(build_optimizer([p], cfg), cfg)
    sched2.load_state_dict(state)
    assert sched2.get_last_lr() == sched.get_last_lr()
    unknown_total = build_lr_scheduler(build_optimizer([p], cfg), OptimConfig(lr=0.1, lr_scheduler="cosine"))
    assert unknown_total.get_last_lr() == [0.1] and lr_multiplier(50, 0, 0, "cosine", 0.0) == 1.0
    with pytest.raises(ValueError):
        build_lr_scheduler(opt, OptimConfig(lr_scheduler="linear"))


def test_backend_registry_imports_on_demand():
    from backends.base import TrainEngine, get_backend

    engine_cls = get_backend("fsdp")
    assert issubclass(engine_cls, TrainEngine) and engine_cls.__name__ == "FSDPEngine"
    with pytest.raises(ValueError, match="unknown backend"):
        get_backend("no_such_backend")
