"""The DeepSpeed ZeRO-3 engine on 2 real gloo ranks against a single-process reference (plain HF model + AdamW).

One 2-process group (~30 s, once: imports and ``deepspeed.initialize``) serves every check
(tests/backends/rank_group.py): each test runs its own ``check_<name>`` on both ranks, so ``pytest -k <name>`` runs
that check and the set-up it asks for. The checks of the main engine follow it through one step (``CHECKS``' order:
fresh, stepped, saved and resumed). Each rank gets half of the rows, so the ZeRO-3 step must equal the reference
step on the whole batch (a token-mean loss), whatever the micro-batch split (``exact_aggregation``: 1 vs 4
micro-batches vs dynamic batch sizes, to 1e-6 relative)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tests.backends.conversion import assert_converts
from tests.backends.multirank import (
    assert_close,
    assert_empty_batch_refused,
    assert_nonfinite_step_skipped,
    assert_step_matches_reference,
)
from tests.backends.rank_group import RankGroup

pytestmark = pytest.mark.slow  # a multi-process group (setup.cfg: `pytest -m "not slow"` skips it)

WORLD = 2
CHECKS = (
    "partitioned",
    "forward_logprobs",
    "train_step_matches_reference",
    "export_buckets",
    "forward_only",
    "reward_scores",
    "exact_aggregation",
    "resume_exact",
    "tampered_checkpoint_refused",
    "save_hf",
    "convert",
    "critic_converts",
    "nonfinite_grad_skips_step",
    "empty_batch_refused",
    "vision_language",
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("deepspeed")
    from tests.backends.tiny import save_tiny_qwen2, save_tiny_reward_model
    from tests.backends.vlm_batch import write_vlm_inputs

    work = tmp_path_factory.mktemp("deepspeed_2rank")
    save_tiny_qwen2(str(work / "model"), seed=0, initializer_range=0.1)
    save_tiny_reward_model(str(work / "rm"))
    write_vlm_inputs(work)
    group = RankGroup("tests.backends.test_deepspeed_engine", work, WORLD, timeout_s=300)
    yield group
    group.close()


@pytest.mark.parametrize("check", CHECKS)
def test_two_rank(ranks, check):
    ranks.assert_passed(check)


# ---------------------------------------------------------------------------------- set-up the checks share
def base(ctx):
    """The model, optimizer, batch and this rank's half of it, the single-process reference step on the whole
    batch, and the main engine (micro-batches of 3)."""
    return ctx.once("base", lambda: _base(ctx))


def _base(ctx):
    import torch
    from transformers import AutoModelForCausalLM

    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig, OptimConfig
    from tests.backends import reference
    from tests.backends.tiny import make_batch

    model_dir = os.path.join(ctx.inputs, "model")
    DS = get_backend("deepspeed")
    # eps 1e-3: Adam's first step is ~lr * sign(grad); a larger eps keeps float noise on near-zero gradients
    # (different reduction order across ranks) from being amplified into weight differences
    optim = OptimConfig(lr=1e-3, eps=1e-3, weight_decay=0.01, grad_clip=1.0, lr_scheduler="cosine", total_steps=4)
    batch = make_batch(8, 12, 10, seed=1)
    rows = list(range(ctx.rank * 4, ctx.rank * 4 + 4))
    share = batch.select_idxs(rows)
    actor_loss, ref_outputs = reference.actor_loss, reference.ref_outputs  # the shared single-process reference
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref_before = ref_outputs(ref, share)
    opt = torch.optim.AdamW(ref.parameters(), lr=optim.lr, eps=optim.eps, weight_decay=optim.weight_decay)
    loss = actor_loss(ref_outputs(ref, batch), batch)[0]
    loss.backward()
    ref_loss, ref_norm = float(loss), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), optim.grad_clip))
    opt.step()
    ref_sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    engine = DS(ModelConfig(path=model_dir), optim, EngineConfig(micro_batch_size_per_gpu=3))
    return SimpleNamespace(
        DS=DS,
        model_dir=model_dir,
        optim=optim,
        rows=rows,
        share=share,
        ref_before=ref_before,
        ref_loss=ref_loss,
        ref_norm=ref_norm,
        ref_sd=ref_sd,
        engine=engine,
    )


def exported(engine, bucket_bytes=1 << 30):
    return {k: v for bucket in engine.export_weights(bucket_bytes) for k, v in bucket}


def stepped(ctx):
    """The main engine after its one step on this rank's rows, which must equal the reference step."""

    def step():
        from tests.backends.reference import actor_loss

        b = base(ctx)
        metrics = b.engine.train_step(b.share, actor_loss, ("log_probs", "entropy"))  # 2 micro-batches: 3 + 1 rows
        weights = exported(b.engine)
        assert_step_matches_reference(metrics, metrics["loss"], weights, b.ref_loss, b.ref_norm, b.ref_sd, b.optim)
        return b.engine

    return ctx.once("stepped", step)


def fresh(ctx):
    """The main engine before any step (the checks of it run first, in ``CHECKS``' order)."""
    engine = base(ctx).engine
    assert engine.global_step == 0, "the main engine has stepped already: run its fresh checks first"
    return engine


# ------------------------------------------------------------------------------------------ per-rank checks
def check_partitioned(ctx):
    engine = fresh(ctx)
    assert engine.dp_rank == ctx.rank and engine.dp_size == WORLD
    for name, p in engine.model.named_parameters():
        assert p.numel() == 0 and 0 < p.ds_tensor.numel() < p.ds_numel, (name, p.ds_tensor.numel(), p.ds_numel)


def check_forward_logprobs(ctx):
    b, engine = base(ctx), fresh(ctx)
    out = engine.forward(b.share, ("log_probs", "entropy"))
    assert_close(out.batch["log_probs"], b.ref_before["log_probs"], "log_probs")
    assert_close(out.batch["entropy"], b.ref_before["entropy"], "entropy")


def check_train_step_matches_reference(ctx):
    stepped(ctx)  # its step is the check


def check_export_buckets(ctx):
    b, engine = base(ctx), stepped(ctx)
    bucket_bytes = 40_000  # embedding 25,344 B, q_proj 16,384 B: buckets of 1-4 tensors
    import deepspeed

    own_gather, calls = deepspeed.zero.GatheredParameters, []

    def counted(params, *args, **kwargs):
        calls.append(len(params))
        return own_gather(params, *args, **kwargs)

    deepspeed.zero.GatheredParameters = counted
    try:
        buckets = list(engine.export_weights(bucket_bytes))
    finally:
        deepspeed.zero.GatheredParameters = own_gather
    # plain partitions take one grouped all-gather per bucket, DeepSpeed's own gather none: it runs only for a bucket
    # holding a parameter a step left gathered (the embedding after this engine's step), which it then releases:
    # the step's own export (``stepped``) did that already
    assert calls == [] and len(buckets) > 3, (calls, len(buckets))
    assert len(buckets) > 3
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= bucket_bytes or len(bucket) == 1, (size, [n for n, _ in bucket])
    assert [n for bucket in buckets for n, _ in bucket] == list(b.ref_sd)
    for name, p in engine.model.named_parameters():
        assert p.numel() == 0, f"{name} stayed gathered after export"


def check_forward_only(ctx):
    import torch

    from backends.config import EngineConfig, ModelConfig
    from tests.backends.reference import actor_loss

    b = base(ctx)
    frozen = b.DS(
        ModelConfig(path=b.model_dir, use_remove_padding=True),
        None,
        EngineConfig(use_dynamic_bsz=True, max_token_len_per_gpu=64),
    )
    assert_close(frozen.forward(b.share, ("log_probs",)).batch["log_probs"], b.ref_before["log_probs"], "frozen")
    assert not any(p.requires_grad for p in frozen.model.parameters())
    try:
        frozen.train_step(b.share, actor_loss)
        raise AssertionError("train_step on a forward-only engine must fail")
    except RuntimeError:
        pass
    frozen.save(os.path.join(ctx.work, "frozen_ckpt"))
    with torch.no_grad():
        for p in frozen.model.parameters():
            p.ds_tensor.zero_()
    frozen.load(os.path.join(ctx.work, "frozen_ckpt"))
    reloaded = frozen.forward(b.share, ("log_probs",)).batch["log_probs"]
    assert_close(reloaded, b.ref_before["log_probs"], "frozen reload")


def check_reward_scores(ctx):
    """The reward model's engine: frozen ZeRO-3 sequence classifier, scored at each row's last token."""
    from backends.config import EngineConfig, ModelConfig
    from tests.backends.tiny import reference_rm_scores

    b, rm_dir = base(ctx), os.path.join(ctx.inputs, "rm")
    rm = b.DS(ModelConfig(path=rm_dir, kind="reward"), None, EngineConfig(micro_batch_size_per_gpu=3))
    scores = rm.forward(b.share, ("scores",)).batch["scores"]
    assert_close(scores, reference_rm_scores(rm_dir, b.share), "rm scores", tol=1e-4)


def check_exact_aggregation(ctx):
    """1 vs 4 micro-batches vs dynamic bsz, 2 ranks vs 1 process (tests/backends/exactness.py)."""
    from backends.config import EngineConfig, ModelConfig
    from tests.backends.exactness import check_exact_aggregation as check

    b = base(ctx)
    check(lambda opt, **kw: b.DS(ModelConfig(path=b.model_dir), opt, EngineConfig(**kw)), b.model_dir, ctx.rank, WORLD)


def check_resume_exact(ctx):
    import torch

    from backends.config import EngineConfig, ModelConfig
    from tests.backends.reference import actor_loss
    from tests.backends.tiny import make_batch

    b, engine = base(ctx), stepped(ctx)
    ckpt = os.path.join(ctx.work, "ckpt")
    later = [make_batch(8, 12, 10, seed=s).select_idxs(b.rows) for s in (2, 3)]

    def steps_2_3(eng):
        return [eng.train_step(batch, actor_loss, ("log_probs", "entropy")) for batch in later]

    engine.save(ckpt)  # after step 1
    draw = torch.rand(4)
    engine.offload()
    engine.onload()
    first = steps_2_3(engine)
    first_weights = exported(engine)
    again = b.DS(ModelConfig(path=b.model_dir), b.optim, EngineConfig(micro_batch_size_per_gpu=3))
    again.load(ckpt)
    assert torch.equal(torch.rand(4), draw), "RNG state not restored"
    assert again.global_step == 1
    second = steps_2_3(again)
    for a, c in zip(first, second):
        assert a == c, (a, c)  # bit-exact: losses, grad norms, learning rates
    assert first[1]["lr"] < first[0]["lr"] < b.optim.lr, first  # the cosine schedule resumed
    for k, v in exported(again).items():
        assert torch.equal(v, first_weights[k]), k


def check_tampered_checkpoint_refused(ctx):
    """DeepSpeed's optimizer-state file of each rank carrying a pickled call (DeepSpeed itself would load it with
    weights_only=False): loading fails naming the file, and the call never ran (tests/backends/tampering.py)."""
    import torch.distributed as dist

    from backends.config import EngineConfig, ModelConfig
    from tests.backends import tampering as t

    b = base(ctx)
    path, marker = t.copy_checkpoint(stepped(ctx), ctx.work, "tampered")
    optim_file = os.path.join(path, "state", f"zero_pp_rank_{ctx.rank}_mp_rank_00_optim_states.pt")
    t.inject_into_torch_file(optim_file, marker)
    dist.barrier()
    fresh = b.DS(ModelConfig(path=b.model_dir), b.optim, EngineConfig(micro_batch_size_per_gpu=3))
    t.assert_refused(lambda: fresh.load(path), [optim_file], marker)


def check_save_hf(ctx):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    engine, hf_dir = stepped(ctx), os.path.join(ctx.work, "hf")
    engine.save_hf(hf_dir)
    weights = exported(engine)
    if ctx.rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        assert loaded.config.architectures == ["Qwen2ForCausalLM"]
        for k, v in loaded.state_dict().items():
            assert torch.equal(v, weights[k]), k
    dist.barrier()


def check_convert(ctx):
    """The checkpoint of the stepped engine converted offline (tests/backends/conversion.py)."""
    assert_converts(stepped(ctx), base(ctx).share, os.path.join(ctx.work, "convert"), ctx.rank)


def check_critic_converts(ctx):
    """A trained ZeRO-3 critic (value head) converts to an HF token classifier with its values."""
    from backends.config import EngineConfig, ModelConfig
    from tests.backends.reference import value_loss

    b = base(ctx)
    critic = b.DS(ModelConfig(path=b.model_dir, kind="value"), b.optim, EngineConfig(micro_batch_size_per_gpu=3))
    critic.train_step(b.share, value_loss, ("values",))
    assert_converts(critic, b.share, os.path.join(ctx.work, "convert_critic"), ctx.rank, kind="value")


def check_nonfinite_grad_skips_step(ctx):
    """The FSDP engine's check (tests/backends/multirank.py): both skip a non-finite step alike."""
    from tests.backends.reference import actor_loss

    assert_nonfinite_step_skipped(stepped(ctx), base(ctx).share, actor_loss, ("log_probs", "entropy"), exported)


def check_empty_batch_refused(ctx):
    from tests.backends.reference import actor_loss

    assert_empty_batch_refused(stepped(ctx), base(ctx).share, actor_loss, ("log_probs", "entropy"))


def check_vision_language(ctx):
    """The tiny Qwen2.5-VL under ZeRO-3: forward (padded, packed) and one step equal plain transformers, and so
    do its values and scores under a value and a reward head (tests/backends/vlm_checks.py)."""
    from tests.backends.vlm_checks import check_vlm_engine

    check_vlm_engine(ctx, "deepspeed")
