"""The FSDP2 engine on 2 real gloo ranks against a single-process reference (plain HF model + torch AdamW).

One 2-process group (its imports cost ~15 s, once) serves every check (tests/backends/rank_group.py): each test runs
its own check, ``check_<name>`` below, on both ranks, so ``pytest -k <name>`` runs that check and the set-up it asks
for. Reference = the same model, optimizer and loss (a token-mean over the whole batch) in one process, with
log-probs from a plain log_softmax; each rank gets half of the rows, so the FSDP step must equal the reference step
whatever the micro-batch split (``exact_aggregation``: 1 vs 4 micro-batches vs dynamic batch sizes, to 1e-6
relative)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tests.backends.conversion import assert_converts
from tests.backends.multirank import assert_close, assert_empty_batch_refused, assert_nonfinite_step_skipped
from tests.backends.rank_group import RankGroup

pytestmark = pytest.mark.slow  # a multi-process group (setup.cfg: `pytest -m "not slow"` skips it)

WORLD = 2
CHECKS = (
    "forward_logprobs",
    "train_step_matches_reference",
    "export_buckets",
    "gather_full_uneven_shards",
    "dynamic_bsz",
    "remove_padding",
    "dynamic_rmpad_checkpointing",
    "nonfinite_grad_skips_step",
    "empty_batch_refused",
    "mixed_precision_bf16",
    "value_model",
    "reward_model",
    "exact_aggregation",
    "resume_exact",
    "tampered_checkpoint_refused",
    "save_hf",
    "convert",
    "vision_language",
)
TOL = 1e-5


# ------------------------------------------------------------------------------------------------ the group
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from tests.backends.tiny import save_tiny_qwen2
    from tests.backends.vlm_batch import write_vlm_inputs

    work = tmp_path_factory.mktemp("fsdp_2rank")
    save_tiny_qwen2(str(work / "model"), seed=0, initializer_range=0.1)
    write_vlm_inputs(work)
    group = RankGroup("tests.backends.test_fsdp_engine", work, WORLD)
    yield group
    group.close()


@pytest.mark.parametrize("check", CHECKS)
def test_two_rank(ranks, check):
    ranks.assert_passed(check)


# ---------------------------------------------------------------------------------- set-up the checks share
def base(ctx):
    """The model, optimizer, batch and this rank's half of it, and the single-process reference step on the whole
    batch (shared with the DeepSpeed and Megatron engine tests: tests/backends/reference.py)."""
    return ctx.once("base", lambda: _base(ctx))


def _base(ctx):

    from backends.base import get_backend
    from backends.config import OptimConfig
    from tests.backends import reference
    from tests.backends.tiny import make_batch

    model_dir = os.path.join(ctx.inputs, "model")
    # eps 1e-6: Adam's first step is ~lr * sign(grad), so with the default 1e-8 a gradient entry near 1e-9 whose
    # float noise differs between layouts (packed vs padded attention) moves its weight by up to 2 * lr
    optim = OptimConfig(lr=1e-3, eps=1e-6, weight_decay=0.01, grad_clip=1.0, lr_scheduler="cosine", total_steps=4)
    batch = make_batch(8, 12, 10, seed=1)
    rows = list(range(ctx.rank * 4, ctx.rank * 4 + 4))
    share = batch.select_idxs(rows)
    ref_before, ref_loss, ref_norm, ref_sd = reference.actor_reference(model_dir, batch, optim, before_on=share)
    return SimpleNamespace(
        FSDP=get_backend("fsdp"),
        model_dir=model_dir,
        optim=optim,
        batch=batch,
        rows=rows,
        share=share,
        ref_before=ref_before,
        ref_loss=ref_loss,
        ref_norm=ref_norm,
        ref_sd=ref_sd,
    )


def exported(engine, bucket_bytes=1 << 30):
    return {k: v for bucket in engine.export_weights(bucket_bytes) for k, v in bucket}


def check_step(b, engine, what):
    """One train_step of ``engine`` on this rank's rows equals the reference step: loss, norm, lr, weights."""
    import torch

    from tests.backends import reference

    metrics = engine.train_step(b.share, reference.actor_loss, ("log_probs", "entropy"))
    assert_close(torch.tensor(metrics["loss"]), torch.tensor(b.ref_loss), f"{what} loss")  # every rank's
    assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(b.ref_norm), f"{what} grad_norm")
    assert metrics["lr"] == b.optim.lr and metrics["step_skipped"] == 0.0 and "pg" in metrics, metrics
    weights = exported(engine)
    assert list(weights) == list(b.ref_sd), f"{what}: names differ"
    for k, v in weights.items():
        assert_close(v, b.ref_sd[k], f"{what} weight {k}")


def stepped_engine(ctx):
    """The main engine (fixed micro-batches of 3) after its one reference step, which must match."""

    def build():
        from backends.config import EngineConfig, ModelConfig

        b = base(ctx)
        engine = b.FSDP(ModelConfig(path=b.model_dir), b.optim, EngineConfig(micro_batch_size_per_gpu=3))
        check_step(b, engine, "fixed padded")
        return engine

    return ctx.once("stepped_engine", build)


VARIANTS = {  # name -> (ModelConfig kwargs, EngineConfig kwargs)
    "dynamic_bsz": ({}, {"use_dynamic_bsz": True, "max_token_len_per_gpu": 40}),
    "remove_padding": ({"use_remove_padding": True}, {"micro_batch_size_per_gpu": 3}),
    "dynamic_rmpad_checkpointing": (
        {"use_remove_padding": True, "enable_gradient_checkpointing": True},
        {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30},
    ),
}


def variant_engine(ctx, name):
    """A fresh engine of one of the batching / padding layouts of ``VARIANTS``."""

    def build():
        from backends.config import EngineConfig, ModelConfig

        b, (model_kw, engine_kw) = base(ctx), VARIANTS[name]
        return b.FSDP(ModelConfig(path=b.model_dir, **model_kw), b.optim, EngineConfig(**engine_kw))

    return ctx.once(name, build)


# ------------------------------------------------------------------------------------------ per-rank checks
def check_forward_logprobs(ctx):
    from backends.config import EngineConfig, ModelConfig
    from tests.backends.reference import actor_loss

    b = base(ctx)
    engine = b.FSDP(ModelConfig(path=b.model_dir), b.optim, EngineConfig(micro_batch_size_per_gpu=3))
    out = engine.forward(b.share, ("log_probs", "entropy", "sum_pi_squared"))
    for name in ("log_probs", "entropy", "sum_pi_squared"):
        assert_close(out.batch[name], b.ref_before[name], name)
    assert engine.dp_rank == ctx.rank and engine.dp_size == WORLD
    frozen = b.FSDP(
        ModelConfig(path=b.model_dir, use_remove_padding=True),
        None,
        EngineConfig(use_dynamic_bsz=True, max_token_len_per_gpu=64),
    )  # a reference policy
    assert_close(frozen.forward(b.share, ("log_probs",)).batch["log_probs"], b.ref_before["log_probs"], "frozen")
    assert not any(p.requires_grad for p in frozen.model.parameters())
    try:
        frozen.train_step(b.share, actor_loss)
        raise AssertionError("train_step on a forward-only engine must fail")
    except RuntimeError:
        pass
    frozen.save(os.path.join(ctx.work, "frozen_ckpt"))
    frozen.load(os.path.join(ctx.work, "frozen_ckpt"))


def check_train_step_matches_reference(ctx):
    stepped_engine(ctx)  # its build is the check (check_step)


def check_export_buckets(ctx):
    b, engine = base(ctx), stepped_engine(ctx)
    bucket_bytes = 40_000  # embedding 25,344 B, q_proj 16,384 B: buckets of 1-4 tensors
    buckets = list(engine.export_weights(bucket_bytes))
    assert len(buckets) > 3
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= bucket_bytes or len(bucket) == 1, (size, [n for n, _ in bucket])
    names = [n for bucket in buckets for n, _ in bucket]
    assert names == list(b.ref_sd), "bucketed names differ from the HF state_dict"
    for bucket in buckets:
        for k, v in bucket:
            assert_close(v, b.ref_sd[k], f"bucket tensor {k}")


def check_gather_full_uneven_shards(ctx):
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from backends.fsdp.gather import gather_full

    engine = stepped_engine(ctx)
    gen = torch.Generator().manual_seed(7)
    full = [  # rows 5: 3 + 2; rows 1: rank 1 holds none; a bf16 and an int64 tensor; a 1-D one
        torch.randn(5, 3, generator=gen),
        torch.randn(1, 4, generator=gen).bfloat16(),
        torch.arange(14).view(7, 2),
        torch.randn(3, generator=gen),
    ]
    values = [distribute_tensor(t, engine.mesh, [Shard(0)]) for t in full]
    values += [distribute_tensor(torch.ones(2, 2), engine.mesh, [Replicate()]), torch.full((2,), 3.0)]
    out = gather_full(values, engine.group)
    for got, want in zip(out, [*full, torch.ones(2, 2), torch.full((2,), 3.0)]):
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


def check_variant(ctx, name):
    """A batching / padding layout: its forward and its step equal the reference's."""
    import torch.distributed as dist

    b, other = base(ctx), variant_engine(ctx, name)
    engine_kw = VARIANTS[name][1]
    if engine_kw.get("use_dynamic_bsz"):
        from backends.batching import token_budget_partition

        lengths = b.share.batch["attention_mask"].sum(-1).tolist()
        local = len(token_budget_partition(lengths, engine_kw["max_token_len_per_gpu"]))
        parts = other._partition(b.share)
        counts = [0] * WORLD
        dist.all_gather_object(counts, (local, len(parts)))
        assert (
            len(parts) > 1 and len({c[1] for c in counts}) == 1 and parts and counts[0][1] == max(c[0] for c in counts)
        ), counts
        for p in parts:
            assert len(p) == 1 or sum(lengths[i] for i in p) <= engine_kw["max_token_len_per_gpu"]
    out = other.forward(b.share, ("log_probs", "entropy"))
    assert_close(out.batch["log_probs"], b.ref_before["log_probs"], f"{name} forward log_probs")
    check_step(b, other, name)


def check_dynamic_bsz(ctx):
    check_variant(ctx, "dynamic_bsz")


def check_remove_padding(ctx):
    check_variant(ctx, "remove_padding")


def check_dynamic_rmpad_checkpointing(ctx):
    check_variant(ctx, "dynamic_rmpad_checkpointing")


def check_nonfinite_grad_skips_step(ctx):
    from tests.backends.reference import actor_loss

    engine = variant_engine(ctx, "dynamic_bsz")
    assert_nonfinite_step_skipped(engine, base(ctx).share, actor_loss, ("log_probs", "entropy"), exported)


def check_empty_batch_refused(ctx):
    from tests.backends.reference import actor_loss

    assert_empty_batch_refused(
        variant_engine(ctx, "dynamic_bsz"), base(ctx).share, actor_loss, ("log_probs", "entropy")
    )


def check_mixed_precision_bf16(ctx):
    import torch

    from backends.config import EngineConfig, ModelConfig
    from tests.backends.reference import actor_loss

    b = base(ctx)
    bf16 = b.FSDP(
        ModelConfig(path=b.model_dir), b.optim, EngineConfig(micro_batch_size_per_gpu=4, mixed_precision="bfloat16")
    )
    out = bf16.forward(b.share, ("log_probs",)).batch["log_probs"]
    assert_close(out, b.ref_before["log_probs"], "bf16 log_probs", tol=0.1)
    metrics = bf16.train_step(b.share, actor_loss, ("log_probs", "entropy"))
    assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(b.ref_norm), "bf16 grad_norm", tol=0.05 * b.ref_norm)
    weights = exported(bf16)
    assert all(v.dtype == torch.float32 for v in weights.values())  # parameters stay float32
    assert max((v - b.ref_sd[k]).abs().max().item() for k, v in weights.items()) < 3 * b.optim.lr


def check_value_model(ctx):
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    from backends.config import EngineConfig, ModelConfig
    from tests.backends import reference

    b = base(ctx)
    torch.manual_seed(7)
    config = AutoConfig.from_pretrained(b.model_dir, num_labels=1)
    config.classifier_dropout = 0.0
    critic_ref = AutoModelForTokenClassification.from_pretrained(b.model_dir, config=config)
    with torch.no_grad():
        before = reference.ref_values(critic_ref, b.share)["values"]
    loss, norm = reference.ref_step(critic_ref, b.batch, reference.value_loss, reference.ref_values, b.optim)
    critic = b.FSDP(
        ModelConfig(path=b.model_dir, kind="value", use_remove_padding=True),
        b.optim,
        EngineConfig(micro_batch_size_per_gpu=3, seed=7),
    )
    assert_close(critic.forward(b.share, ("values",)).batch["values"], before, "values")
    metrics = critic.train_step(b.share, reference.value_loss, ("values",))
    assert_close(torch.tensor(metrics["loss"]), torch.tensor(loss), "value loss")
    assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(norm), "value grad_norm")
    for k, v in exported(critic).items():
        assert_close(v, critic_ref.state_dict()[k], f"critic weight {k}")
    assert_converts(critic, b.share, os.path.join(ctx.work, "convert_critic"), ctx.rank, kind="value")


def check_reward_model(ctx):
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from backends.config import EngineConfig, ModelConfig

    b = base(ctx)
    config = AutoConfig.from_pretrained(b.model_dir, num_labels=1)
    torch.manual_seed(5)
    rm_ref = AutoModelForSequenceClassification.from_pretrained(b.model_dir, config=config)
    rm = b.FSDP(
        ModelConfig(path=b.model_dir, kind="reward", use_remove_padding=True),
        b.optim,
        EngineConfig(use_dynamic_bsz=True, max_token_len_per_gpu=40, seed=5),
    )
    scores = rm.forward(b.share, ("scores",)).batch["scores"]
    t = b.share.batch
    with torch.no_grad():  # each row alone, unpadded: the score at its last token
        alone = torch.stack(
            [
                rm_ref(input_ids=t["input_ids"][i][t["attention_mask"][i].bool()][None]).logits[0, 0]
                for i in range(len(b.share))
            ]
        )
    assert_close(scores, alone, "reward scores")


def check_exact_aggregation(ctx):
    """1 vs 4 micro-batches vs dynamic bsz, 2 ranks vs 1 process (tests/backends/exactness.py)."""
    from backends.config import EngineConfig, ModelConfig
    from tests.backends.exactness import check_exact_aggregation as check

    b = base(ctx)
    check(
        lambda opt, **kw: b.FSDP(ModelConfig(path=b.model_dir), opt, EngineConfig(**kw)), b.model_dir, ctx.rank, WORLD
    )


def check_resume_exact(ctx):
    """Saved after step 1, steps 2-3 on the engine and on a fresh (offloaded) one loaded from the save: bit-equal."""
    import torch

    from backends.config import EngineConfig, ModelConfig
    from tests.backends.reference import actor_loss
    from tests.backends.tiny import make_batch

    b, engine = base(ctx), stepped_engine(ctx)
    ckpt = os.path.join(ctx.work, "ckpt")
    later = [make_batch(8, 12, 10, seed=s).select_idxs(b.rows) for s in (2, 3)]

    def steps_2_3(eng):
        return [eng.train_step(batch, actor_loss, ("log_probs", "entropy")) for batch in later]

    assert engine.global_step == 1
    engine.save(ckpt)  # after step 1
    draw = torch.rand(4)
    engine.offload()
    engine.onload()
    first = steps_2_3(engine)
    first_weights = exported(engine)
    fresh = b.FSDP(
        ModelConfig(path=b.model_dir),
        b.optim,
        EngineConfig(micro_batch_size_per_gpu=3, param_offload=True, optimizer_offload=True),
    )
    fresh.load(ckpt)
    assert torch.equal(torch.rand(4), draw), "RNG state not restored"
    assert fresh.global_step == 1
    second = steps_2_3(fresh)
    for a, c in zip(first, second):
        assert a == c, (a, c)  # bit-exact: losses, grad norms, learning rates
    assert first[1]["lr"] < first[0]["lr"] < b.optim.lr, first  # the cosine schedule resumed
    for k, v in exported(fresh).items():
        assert torch.equal(v, first_weights[k]), k


def check_tampered_checkpoint_refused(ctx):
    """A checkpoint whose DCP ``.metadata``, or one of whose byte items, is a pickled call: loading it fails on
    both ranks naming the file, and the call never ran (tests/backends/tampering.py)."""
    import torch.distributed as dist

    from backends.config import EngineConfig, ModelConfig
    from tests.backends import tampering as t

    b, engine = base(ctx), stepped_engine(ctx)
    fresh = b.FSDP(ModelConfig(path=b.model_dir), b.optim, EngineConfig(micro_batch_size_per_gpu=3))
    for name, tamper in (("metadata", t.replace_dcp_metadata), ("bytes_item", t.redirect_dcp_bytes_item)):
        path, marker = t.copy_checkpoint(engine, ctx.work, f"tampered_{name}")
        dcp_dir = os.path.join(path, "dcp")
        if ctx.rank == 0:
            tamper(dcp_dir, marker)
        dist.barrier()
        named = [os.path.join(dcp_dir, ".metadata")] if name == "metadata" else [dcp_dir, "param_groups"]
        t.assert_refused(lambda path=path: fresh.load(path), named, marker)


def check_save_hf(ctx):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.backends.reference import ref_outputs

    b, engine = base(ctx), stepped_engine(ctx)
    hf_dir = os.path.join(ctx.work, "hf")
    engine.save_hf(hf_dir)
    out = engine.forward(b.share, ("log_probs",)).batch["log_probs"]
    weights = exported(engine)
    if ctx.rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        assert loaded.config.architectures == ["Qwen2ForCausalLM"] and loaded.config.use_cache
        for k, v in loaded.state_dict().items():
            assert torch.equal(v, weights[k]), k
        with torch.no_grad():
            assert_close(ref_outputs(loaded, b.share)["log_probs"], out, "save_hf log_probs")
        assert AutoTokenizer.from_pretrained(hf_dir)("1+1").input_ids
        assert not any(f.startswith("model-") for f in os.listdir(hf_dir))  # one shard: model.safetensors
    dist.barrier()


def check_convert(ctx):
    """The checkpoint of the stepped engine converted offline (tests/backends/conversion.py)."""
    assert_converts(stepped_engine(ctx), base(ctx).share, os.path.join(ctx.work, "convert"), ctx.rank)


def check_vision_language(ctx):
    """The tiny Qwen2.5-VL: forward (padded, packed) and one step equal plain transformers, and so do its values
    and scores under a value and a reward head (tests/backends/vlm_checks.py)."""
    from tests.backends.vlm_checks import check_vlm_engine

    check_vlm_engine(ctx, "fsdp")
