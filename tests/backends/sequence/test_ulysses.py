"""Ulysses sequence parallelism (backends/sequence/ulysses.py) on real gloo ranks: SP=2 on 2 ranks, SP=2 x DP=2 and
SP=4 on 4 ranks, fsdp and deepspeed, against the single-process reference (tests/backends/reference.py: the same
model and AdamW step on the whole batch, which is what SP=1 computes, tests/backends/test_fsdp_engine.py) and against
the SP=1 engine itself where the reference has no single-process form (LoRA, the critic).

A Ulysses group's ranks hold the same rows (the engine's DP rank is rank // SP, its output kept on the group's first
rank) and each computes a slice of the packed sequence; a wrong all-to-all, a missing gradient sum over the group or
a wrong gradient scale changes the log-probs, the loss, the gradient norm or the weights after the step, to 1e-5.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tests.backends.multirank import assert_close, assert_step_matches_reference
from tests.backends.rank_group import GroupsByWorld

pytestmark = pytest.mark.slow  # multi-process groups

CHECKS = {  # world size -> its checks
    2: (
        "fsdp_sp2",
        "fsdp_sp2_dynamic_bsz_checkpointing",
        "fsdp_sp2_lora",
        "fsdp_sp2_critic",
        "fsdp_sp2_reward_model",
        "deepspeed_sp2",
        "needs_remove_padding",
    ),
    4: ("fsdp_sp2_dp2", "deepspeed_sp2_dp2", "fsdp_sp4_repeats_kv_heads"),
}
OUTPUTS = ("log_probs", "entropy")


@pytest.fixture(scope="module")
def group_of(tmp_path_factory):
    """``group_of(world)``: the serving group of that many ranks; the other world size's ends first."""
    from tests.backends.tiny import save_tiny_qwen2

    work = tmp_path_factory.mktemp("ulysses")
    save_tiny_qwen2(str(work / "model"), seed=0, initializer_range=0.1)
    groups = GroupsByWorld("tests.backends.sequence.test_ulysses", work)
    yield groups
    groups.close()


@pytest.mark.parametrize("world, check", [(w, c) for w, checks in CHECKS.items() for c in checks])
def test_ulysses(group_of, world, check):
    group_of(world).assert_passed(check)


# ---------------------------------------------------------------------------------- set-up the checks share
def base(ctx):
    return ctx.once("base", lambda: _base(ctx))


def _base(ctx):

    from backends.config import OptimConfig
    from tests.backends import reference
    from tests.backends.tiny import make_batch

    model_dir = os.path.join(ctx.inputs, "model")
    optim = OptimConfig(lr=1e-3, eps=1e-6, weight_decay=0.01, grad_clip=1.0, lr_scheduler="cosine", total_steps=4)
    # long enough that a rank's slice cuts through rows, short rows so that some slices hold no response token
    batch = make_batch(8, 12, 10, seed=3)
    ref_before, ref_loss, ref_norm, ref_sd = reference.actor_reference(model_dir, batch, optim)
    return SimpleNamespace(
        model_dir=model_dir,
        optim=optim,
        batch=batch,
        ref_before=ref_before,
        ref_loss=ref_loss,
        ref_norm=ref_norm,
        ref_sd=ref_sd,
    )


def share(batch, dp_rank: int, dp_size: int):
    rows = len(batch) // dp_size
    return batch.select_idxs(list(range(dp_rank * rows, (dp_rank + 1) * rows)))


def engine(backend: str, b, sp: int, kind: str = "causal_lm", optim=True, **settings):
    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig

    model = ModelConfig(path=b.model_dir, kind=kind, use_remove_padding=True, **settings.pop("model", {}))
    config = EngineConfig(micro_batch_size_per_gpu=3, ulysses_sequence_parallel_size=sp, **settings)
    return get_backend(backend)(model, b.optim if optim else None, config)


def exported(eng):
    return {k: v for bucket in eng.export_weights(1 << 30) for k, v in bucket}


def assert_layout(eng, ctx, sp: int) -> None:
    """The engine's place: DP rank = rank // SP over world / SP ranks, the output of each group's first rank kept."""
    assert (eng.dp_rank, eng.dp_size) == (ctx.rank // sp, ctx.world // sp), (eng.dp_rank, eng.dp_size)
    assert eng.collects_output == (ctx.rank % sp == 0)


def check_against_reference(ctx, backend: str, sp: int, **settings) -> None:
    """Forward log-probs / entropy and one train step of an SP engine on its DP share equal the reference's."""
    from tests.backends import reference

    b = base(ctx)
    eng = engine(backend, b, sp, **settings)
    assert_layout(eng, ctx, sp)
    mine = share(b.batch, eng.dp_rank, eng.dp_size)
    before = share(as_batch(b.ref_before), eng.dp_rank, eng.dp_size)
    out = eng.forward(mine, OUTPUTS)
    for key in OUTPUTS:
        assert_close(out.batch[key], before.batch[key], f"{backend} SP={sp} forward {key}")
    metrics = eng.train_step(mine, reference.actor_loss, OUTPUTS)
    assert_step_matches_reference(metrics, metrics["loss"], exported(eng), b.ref_loss, b.ref_norm, b.ref_sd, b.optim)


def as_batch(outputs: dict):
    """The reference's outputs as a DataProto, to take a DP rank's share of them."""
    from scaletrain.protocol import DataProto

    return DataProto.from_dict(dict(outputs))


# ---------------------------------------------------------------------------------------------- the checks
def check_fsdp_sp2(ctx):
    check_against_reference(ctx, "fsdp", 2)


def check_fsdp_sp2_dynamic_bsz_checkpointing(ctx):
    check_against_reference(
        ctx, "fsdp", 2, use_dynamic_bsz=True, max_token_len_per_gpu=48, model={"enable_gradient_checkpointing": True}
    )


def check_deepspeed_sp2(ctx):
    check_against_reference(ctx, "deepspeed", 2)


def check_fsdp_sp2_dp2(ctx):
    check_against_reference(ctx, "fsdp", 2)


def check_deepspeed_sp2_dp2(ctx):
    check_against_reference(ctx, "deepspeed", 2, use_dynamic_bsz=True, max_token_len_per_gpu=48)


def check_fsdp_sp4_repeats_kv_heads(ctx):
    check_against_reference(ctx, "fsdp", 4)  # the tiny model's 2 KV heads do not split over 4 ranks


def against_sp1(ctx, kind: str, loss_fn, outputs, **settings) -> None:
    """An SP=2 engine's forward and train step equal the SP=1 engine's (2 DP ranks) on the same batch."""
    import torch

    b = base(ctx)
    results = {}
    for sp in (1, 2):
        eng = engine("fsdp", b, sp, kind=kind, **settings)
        mine = share(b.batch, eng.dp_rank, eng.dp_size)
        out = eng.forward(mine, outputs)
        metrics = eng.train_step(mine, loss_fn, outputs)
        # the whole batch's outputs: SP=1 ranks hold half the rows each
        gathered = [None] * ctx.world
        torch.distributed.all_gather_object(gathered, {k: out.batch[k] for k in outputs})
        full = gathered[0] if sp == 2 else {k: torch.cat([g[k] for g in gathered]) for k in outputs}
        results[sp] = (full, metrics, exported(eng))
    (out1, m1, w1), (out2, m2, w2) = results[1], results[2]
    for k in outputs:
        assert_close(out2[k], out1[k], f"{kind} {k}")
    for k in ("loss", "grad_norm"):
        assert_close(torch.tensor(m2[k]), torch.tensor(m1[k]), f"{kind} {k}")
    assert list(w2) == list(w1)
    for k in w1:
        assert_close(w2[k], w1[k], f"{kind} weight {k}")


def check_fsdp_sp2_lora(ctx):
    from tests.backends import reference

    against_sp1(ctx, "causal_lm", reference.actor_loss, OUTPUTS, model={"lora_rank": 4, "lora_alpha": 8})


def check_fsdp_sp2_critic(ctx):
    from tests.backends import reference

    against_sp1(ctx, "value", reference.value_loss, ("values",), seed=7)


def check_fsdp_sp2_reward_model(ctx):
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    b = base(ctx)
    torch.manual_seed(5)
    rm_ref = AutoModelForSequenceClassification.from_pretrained(
        b.model_dir, config=AutoConfig.from_pretrained(b.model_dir, num_labels=1)
    )
    rm = engine("fsdp", b, 2, kind="reward", optim=False, seed=5)
    scores = rm.forward(b.batch, ("scores",)).batch["scores"]
    t = b.batch.batch
    with torch.no_grad():  # each row alone, unpadded: the score at its last token
        alone = torch.stack(
            [rm_ref(input_ids=t["input_ids"][i][t["attention_mask"][i].bool()][None]).logits[0, 0] for i in range(8)]
        )
    assert_close(scores, alone, "reward scores")


def check_needs_remove_padding(ctx):
    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig

    b = base(ctx)
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=2 needs the model's use_remove_padding"):
        get_backend("fsdp")(ModelConfig(path=b.model_dir), None, EngineConfig(ulysses_sequence_parallel_size=2))
