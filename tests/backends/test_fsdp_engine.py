"""The FSDP2 engine on 2 real gloo ranks against a single-process reference (plain HF model + torch AdamW).

One 2-process launch (a launch costs ~15 s of imports) runs every check in ``run_rank``; each rank writes a JSON
of {check: error or null} and the tests below report one check each. Reference = the same model, optimizer
and loss (a token-mean over the whole batch) in one process, with log-probs from a plain log_softmax; each rank gets
half of the rows, so the FSDP step must equal the reference step whatever the micro-batch split
(``exact_aggregation``: 1 vs 4 micro-batches vs dynamic batch sizes, to 1e-6 relative).
"""

from __future__ import annotations

import os

import pytest

from tests.backends.multirank import (
    assert_close,
    assert_empty_batch_refused,
    assert_nonfinite_step_skipped,
    assert_ranks_passed,
    launch,
    rank_check,
    run_checks,
)

pytestmark = pytest.mark.slow  # a multi-process launch (setup.cfg: `pytest -m "not slow"` skips it)

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
    "save_hf",
)
TOL = 1e-5


# ------------------------------------------------------------------------------------------------ launcher
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.backends.tiny import save_tiny_qwen2

    work = tmp_path_factory.mktemp("fsdp_2rank")
    save_tiny_qwen2(str(work / "model"), seed=0, initializer_range=0.1)
    return launch("tests.backends.test_fsdp_engine", work, WORLD, timeout_s=240)


@pytest.mark.parametrize("check", CHECKS)
def test_two_rank(results, check):
    assert_ranks_passed(results, check)


# ------------------------------------------------------------------------------------------ per-rank checks
def run_rank(work: str) -> None:
    run_checks(work, _run_checks)


def _run_checks(work: str, rank: int, results: dict) -> None:
    import torch
    import torch.distributed as dist
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        AutoTokenizer,
    )

    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig, OptimConfig
    from tests.backends import reference
    from tests.backends.exactness import check_exact_aggregation
    from tests.backends.tiny import make_batch

    model_dir = os.path.join(work, "model")
    FSDP = get_backend("fsdp")
    # eps 1e-6: Adam's first step is ~lr * sign(grad), so with the default 1e-8 a gradient entry near 1e-9 whose
    # float noise differs between layouts (packed vs padded attention) moves its weight by up to 2 * lr
    optim = OptimConfig(lr=1e-3, eps=1e-6, weight_decay=0.01, grad_clip=1.0, lr_scheduler="cosine", total_steps=4)
    batch = make_batch(8, 12, 10, seed=1)
    rows = list(range(rank * 4, rank * 4 + 4))
    share = batch.select_idxs(rows)

    # the single-process reference (shared with the DeepSpeed and Megatron engine tests)
    actor_loss, ref_outputs = reference.actor_loss, reference.ref_outputs

    def ref_step(model, data, loss_fn, outputs_fn):
        return reference.ref_step(model, data, loss_fn, outputs_fn, optim)

    def exported(engine, bucket_bytes=1 << 30):
        return {k: v for bucket in engine.export_weights(bucket_bytes) for k, v in bucket}

    # ---- reference: one step on the whole batch in this process
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref_before = ref_outputs(ref, share)
    ref_loss, ref_norm = ref_step(ref, batch, actor_loss, ref_outputs)
    ref_sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}

    def check_step(engine, what):
        metrics = engine.train_step(share, actor_loss, ("log_probs", "entropy"))
        assert_close(torch.tensor(metrics["loss"]), torch.tensor(ref_loss), f"{what} loss")  # every rank's
        assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(ref_norm), f"{what} grad_norm")
        assert metrics["lr"] == optim.lr and metrics["step_skipped"] == 0.0 and "pg" in metrics, metrics
        weights = exported(engine)
        assert list(weights) == list(ref_sd), f"{what}: names differ"
        for k, v in weights.items():
            assert_close(v, ref_sd[k], f"{what} weight {k}")

    engine = FSDP(ModelConfig(path=model_dir), optim, EngineConfig(micro_batch_size_per_gpu=3))

    @rank_check(results, "forward_logprobs")
    def _():
        out = engine.forward(share, ("log_probs", "entropy"))
        assert_close(out.batch["log_probs"], ref_before["log_probs"], "log_probs")
        assert_close(out.batch["entropy"], ref_before["entropy"], "entropy")
        assert engine.dp_rank == rank and engine.dp_size == WORLD
        frozen = FSDP(
            ModelConfig(path=model_dir, use_remove_padding=True),
            None,
            EngineConfig(use_dynamic_bsz=True, max_token_len_per_gpu=64),
        )  # a reference policy
        assert_close(
            frozen.forward(share, ("log_probs",)).batch["log_probs"], ref_before["log_probs"], "frozen log_probs"
        )
        assert not any(p.requires_grad for p in frozen.model.parameters())
        try:
            frozen.train_step(share, actor_loss)
            raise AssertionError("train_step on a forward-only engine must fail")
        except RuntimeError:
            pass
        frozen.save(os.path.join(work, "frozen_ckpt"))
        frozen.load(os.path.join(work, "frozen_ckpt"))

    @rank_check(results, "train_step_matches_reference")
    def _():
        check_step(engine, "fixed padded")

    @rank_check(results, "export_buckets")
    def _():
        bucket_bytes = 40_000  # embedding 25,344 B, q_proj 16,384 B: buckets of 1-4 tensors
        buckets = list(engine.export_weights(bucket_bytes))
        assert len(buckets) > 3
        for bucket in buckets:
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            assert size <= bucket_bytes or len(bucket) == 1, (size, [n for n, _ in bucket])
        names = [n for bucket in buckets for n, _ in bucket]
        assert names == list(ref_sd), "bucketed names differ from the HF state_dict"
        for bucket in buckets:
            for k, v in bucket:
                assert_close(v, ref_sd[k], f"bucket tensor {k}")

    @rank_check(results, "gather_full_uneven_shards")
    def _():
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        from backends.fsdp.gather import gather_full

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

    engines = {}
    for name, cfg in (
        ("dynamic_bsz", (ModelConfig(path=model_dir), EngineConfig(use_dynamic_bsz=True, max_token_len_per_gpu=40))),
        (
            "remove_padding",
            (ModelConfig(path=model_dir, use_remove_padding=True), EngineConfig(micro_batch_size_per_gpu=3)),
        ),
        (
            "dynamic_rmpad_checkpointing",
            (
                ModelConfig(path=model_dir, use_remove_padding=True, gradient_checkpointing=True),
                EngineConfig(use_dynamic_bsz=True, max_token_len_per_gpu=30),
            ),
        ),
    ):

        @rank_check(results, name)
        def _():
            other = FSDP(cfg[0], optim, cfg[1])
            if cfg[1].use_dynamic_bsz:
                from backends.batching import token_budget_partition

                lengths = share.batch["attention_mask"].sum(-1).tolist()
                local = len(token_budget_partition(lengths, cfg[1].max_token_len_per_gpu))
                parts = other._partition(share)
                counts = [0] * WORLD
                dist.all_gather_object(counts, (local, len(parts)))
                assert (
                    len(parts) > 1
                    and len({c[1] for c in counts}) == 1
                    and parts
                    and counts[0][1] == max(c[0] for c in counts)
                ), counts
                for p in parts:
                    assert len(p) == 1 or sum(lengths[i] for i in p) <= cfg[1].max_token_len_per_gpu
            out = other.forward(share, ("log_probs", "entropy"))
            assert_close(out.batch["log_probs"], ref_before["log_probs"], f"{name} forward log_probs")
            check_step(other, name)
            engines[name] = other

    @rank_check(results, "nonfinite_grad_skips_step")
    def _():
        assert_nonfinite_step_skipped(engines["dynamic_bsz"], share, actor_loss, ("log_probs", "entropy"), exported)

    @rank_check(results, "empty_batch_refused")
    def _():
        assert_empty_batch_refused(engines["dynamic_bsz"], share, actor_loss, ("log_probs", "entropy"))

    @rank_check(results, "mixed_precision_bf16")
    def _():
        bf16 = FSDP(
            ModelConfig(path=model_dir), optim, EngineConfig(micro_batch_size_per_gpu=4, mixed_precision="bfloat16")
        )
        out = bf16.forward(share, ("log_probs",)).batch["log_probs"]
        assert_close(out, ref_before["log_probs"], "bf16 log_probs", tol=0.1)
        metrics = bf16.train_step(share, actor_loss, ("log_probs", "entropy"))
        assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(ref_norm), "bf16 grad_norm", tol=0.05 * ref_norm)
        weights = exported(bf16)
        assert all(v.dtype == torch.float32 for v in weights.values())  # parameters stay float32
        assert max((v - ref_sd[k]).abs().max().item() for k, v in weights.items()) < 3 * optim.lr

    @rank_check(results, "value_model")
    def _():
        value_loss, ref_values = reference.value_loss, reference.ref_values

        torch.manual_seed(7)
        config = AutoConfig.from_pretrained(model_dir, num_labels=1)
        config.classifier_dropout = 0.0
        critic_ref = AutoModelForTokenClassification.from_pretrained(model_dir, config=config)
        with torch.no_grad():
            before = ref_values(critic_ref, share)["values"]
        loss, norm = ref_step(critic_ref, batch, value_loss, ref_values)
        critic = FSDP(
            ModelConfig(path=model_dir, kind="value", use_remove_padding=True),
            optim,
            EngineConfig(micro_batch_size_per_gpu=3, seed=7),
        )
        assert_close(critic.forward(share, ("values",)).batch["values"], before, "values")
        metrics = critic.train_step(share, value_loss, ("values",))
        assert_close(torch.tensor(metrics["loss"]), torch.tensor(loss), "value loss")
        assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(norm), "value grad_norm")
        for k, v in exported(critic).items():
            assert_close(v, critic_ref.state_dict()[k], f"critic weight {k}")

    @rank_check(results, "reward_model")
    def _():
        config = AutoConfig.from_pretrained(model_dir, num_labels=1)
        torch.manual_seed(5)
        rm_ref = AutoModelForSequenceClassification.from_pretrained(model_dir, config=config)
        rm = FSDP(
            ModelConfig(path=model_dir, kind="reward", use_remove_padding=True),
            optim,
            EngineConfig(use_dynamic_bsz=True, max_token_len_per_gpu=40, seed=5),
        )
        scores = rm.forward(share, ("scores",)).batch["scores"]
        b = share.batch
        with torch.no_grad():  # each row alone, unpadded: the score at its last token
            alone = torch.stack(
                [
                    rm_ref(input_ids=b["input_ids"][i][b["attention_mask"][i].bool()][None]).logits[0, 0]
                    for i in range(len(share))
                ]
            )
        assert_close(scores, alone, "reward scores")

    @rank_check(results, "exact_aggregation")
    def _():  # 1 vs 4 micro-batches vs dynamic bsz, 2 ranks vs 1 process (tests/backends/exactness.py)
        check_exact_aggregation(
            lambda opt, **kw: FSDP(ModelConfig(path=model_dir), opt, EngineConfig(**kw)), model_dir, rank, WORLD
        )

    ckpt, hf_dir = os.path.join(work, "ckpt"), os.path.join(work, "hf")
    later = [make_batch(8, 12, 10, seed=s).select_idxs(rows) for s in (2, 3)]

    def steps_2_3(eng):
        return [eng.train_step(b, actor_loss, ("log_probs", "entropy")) for b in later]

    @rank_check(results, "resume_exact")
    def _():
        engine.save(ckpt)  # after step 1
        draw = torch.rand(4)
        engine.offload()
        engine.onload()
        first = steps_2_3(engine)
        first_weights = exported(engine)
        fresh = FSDP(
            ModelConfig(path=model_dir),
            optim,
            EngineConfig(micro_batch_size_per_gpu=3, param_offload=True, optimizer_offload=True),
        )
        fresh.load(ckpt)
        assert torch.equal(torch.rand(4), draw), "RNG state not restored"
        assert fresh.global_step == 1
        second = steps_2_3(fresh)
        for a, b in zip(first, second):
            assert a == b, (a, b)  # bit-exact: losses, grad norms, learning rates
        assert first[1]["lr"] < first[0]["lr"] < optim.lr, first  # the cosine schedule resumed
        for k, v in exported(fresh).items():
            assert torch.equal(v, first_weights[k]), k

    @rank_check(results, "save_hf")
    def _():
        engine.save_hf(hf_dir)
        out = engine.forward(share, ("log_probs",)).batch["log_probs"]
        weights = exported(engine)
        if rank == 0:
            loaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
            assert loaded.config.architectures == ["Qwen2ForCausalLM"] and loaded.config.use_cache
            for k, v in loaded.state_dict().items():
                assert torch.equal(v, weights[k]), k
            with torch.no_grad():
                assert_close(ref_outputs(loaded, share)["log_probs"], out, "save_hf log_probs")
            assert AutoTokenizer.from_pretrained(hf_dir)("1+1").input_ids
            assert not any(f.startswith("model-") for f in os.listdir(hf_dir))  # one shard: model.safetensors
        dist.barrier()

    dist.barrier()
    dist.destroy_process_group()
