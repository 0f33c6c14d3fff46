"""The DeepSpeed ZeRO-3 engine on 2 real gloo ranks against a single-process reference (plain HF model + AdamW).

One 2-process launch (~30 s: imports and ``deepspeed.initialize``) runs every check in ``run_rank``; each rank
writes a JSON of {check: error or null} and the tests below report one check each. Each rank gets half of the
rows, so the ZeRO-3 step must equal the reference step on the whole batch (a token-mean loss), whatever the
micro-batch split (``exact_aggregation``: 1 vs 4 micro-batches vs dynamic batch sizes, to 1e-6 relative).
"""

from __future__ import annotations

import os

import pytest

from tests.backends.multirank import (
    assert_close,
    assert_empty_batch_refused,
    assert_nonfinite_step_skipped,
    assert_ranks_passed,
    assert_step_matches_reference,
    launch,
    rank_check,
    run_checks,
)

pytestmark = pytest.mark.slow  # a multi-process launch (setup.cfg: `pytest -m "not slow"` skips it)

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
    "save_hf",
    "nonfinite_grad_skips_step",
    "empty_batch_refused",
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("deepspeed")
    from tests.backends.tiny import save_tiny_qwen2, save_tiny_reward_model

    work = tmp_path_factory.mktemp("deepspeed_2rank")
    save_tiny_qwen2(str(work / "model"), seed=0, initializer_range=0.1)
    save_tiny_reward_model(str(work / "rm"))
    return launch("tests.backends.test_deepspeed_engine", work, WORLD, timeout_s=300)


@pytest.mark.parametrize("check", CHECKS)
def test_two_rank(results, check):
    assert_ranks_passed(results, check)


# ------------------------------------------------------------------------------------------ per-rank checks
def run_rank(work: str) -> None:
    run_checks(work, _run_checks)


def _run_checks(work: str, rank: int, results: dict) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig, OptimConfig
    from tests.backends import reference
    from tests.backends.exactness import check_exact_aggregation
    from tests.backends.tiny import make_batch, reference_rm_scores

    model_dir = os.path.join(work, "model")
    DS = get_backend("deepspeed")
    # eps 1e-3: Adam's first step is ~lr * sign(grad); a larger eps keeps float noise on near-zero gradients
    # (different reduction order across ranks) from being amplified into weight differences
    optim = OptimConfig(lr=1e-3, eps=1e-3, weight_decay=0.01, grad_clip=1.0, lr_scheduler="cosine", total_steps=4)
    batch = make_batch(8, 12, 10, seed=1)
    rows = list(range(rank * 4, rank * 4 + 4))
    share = batch.select_idxs(rows)

    actor_loss, ref_outputs = reference.actor_loss, reference.ref_outputs  # the shared single-process reference

    def exported(engine, bucket_bytes=1 << 30):
        return {k: v for bucket in engine.export_weights(bucket_bytes) for k, v in bucket}

    # ---- reference: one step on the whole batch in this process
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

    @rank_check(results, "partitioned")
    def _():
        assert engine.dp_rank == rank and engine.dp_size == WORLD
        for name, p in engine.model.named_parameters():
            assert p.numel() == 0 and 0 < p.ds_tensor.numel() < p.ds_numel, (name, p.ds_tensor.numel(), p.ds_numel)

    @rank_check(results, "forward_logprobs")
    def _():
        out = engine.forward(share, ("log_probs", "entropy"))
        assert_close(out.batch["log_probs"], ref_before["log_probs"], "log_probs")
        assert_close(out.batch["entropy"], ref_before["entropy"], "entropy")

    @rank_check(results, "train_step_matches_reference")
    def _():
        metrics = engine.train_step(share, actor_loss, ("log_probs", "entropy"))  # 2 micro-batches: 3 + 1 rows
        assert_step_matches_reference(metrics, metrics["loss"], exported(engine), ref_loss, ref_norm, ref_sd, optim)

    @rank_check(results, "export_buckets")
    def _():
        bucket_bytes = 40_000  # embedding 25,344 B, q_proj 16,384 B: buckets of 1-4 tensors
        buckets = list(engine.export_weights(bucket_bytes))
        assert len(buckets) > 3
        for bucket in buckets:
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            assert size <= bucket_bytes or len(bucket) == 1, (size, [n for n, _ in bucket])
        assert [n for bucket in buckets for n, _ in bucket] == list(ref_sd)
        for name, p in engine.model.named_parameters():
            assert p.numel() == 0, f"{name} stayed gathered after export"

    @rank_check(results, "forward_only")
    def _():
        frozen = DS(
            ModelConfig(path=model_dir, use_remove_padding=True),
            None,
            EngineConfig(use_dynamic_bsz=True, max_token_len_per_gpu=64),
        )
        assert_close(frozen.forward(share, ("log_probs",)).batch["log_probs"], ref_before["log_probs"], "frozen")
        assert not any(p.requires_grad for p in frozen.model.parameters())
        try:
            frozen.train_step(share, actor_loss)
            raise AssertionError("train_step on a forward-only engine must fail")
        except RuntimeError:
            pass
        frozen.save(os.path.join(work, "frozen_ckpt"))
        with torch.no_grad():
            for p in frozen.model.parameters():
                p.ds_tensor.zero_()
        frozen.load(os.path.join(work, "frozen_ckpt"))
        assert_close(frozen.forward(share, ("log_probs",)).batch["log_probs"], ref_before["log_probs"], "frozen reload")

    @rank_check(results, "reward_scores")
    def _():  # the reward model's engine: frozen ZeRO-3 sequence classifier, scored at each row's last token
        rm_dir = os.path.join(work, "rm")
        rm = DS(ModelConfig(path=rm_dir, kind="reward"), None, EngineConfig(micro_batch_size_per_gpu=3))
        assert_close(
            rm.forward(share, ("scores",)).batch["scores"], reference_rm_scores(rm_dir, share), "rm scores", tol=1e-4
        )

    @rank_check(results, "exact_aggregation")
    def _():  # 1 vs 4 micro-batches vs dynamic bsz, 2 ranks vs 1 process (tests/backends/exactness.py)
        check_exact_aggregation(
            lambda opt, **kw: DS(ModelConfig(path=model_dir), opt, EngineConfig(**kw)), model_dir, rank, WORLD
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
        fresh = DS(ModelConfig(path=model_dir), optim, EngineConfig(micro_batch_size_per_gpu=3))
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
        weights = exported(engine)
        if rank == 0:
            loaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
            assert loaded.config.architectures == ["Qwen2ForCausalLM"]
            for k, v in loaded.state_dict().items():
                assert torch.equal(v, weights[k]), k
        dist.barrier()

    @rank_check(results, "nonfinite_grad_skips_step")
    def _():  # the FSDP engine's check (tests/backends/multirank.py): both skip a non-finite step alike
        assert_nonfinite_step_skipped(engine, share, actor_loss, ("log_probs", "entropy"), exported)

    @rank_check(results, "empty_batch_refused")
    def _():
        assert_empty_batch_refused(engine, share, actor_loss, ("log_probs", "entropy"))

    dist.barrier()
    dist.destroy_process_group()
