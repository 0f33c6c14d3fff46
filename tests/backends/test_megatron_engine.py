"""The Megatron-core engine against the single-process reference (tests/backends/reference.py).

- The HF <-> Megatron mapping round trip, as pure functions (no processes), for TP 1/2 x PP 1/2, Qwen2 (QKV bias)
  and Llama, GQA, tied and untied embeddings, value heads.
- One 2-rank launch runs three layouts one after the other (TP=2 with sequence parallelism; PP=2 with tied
  embeddings across stages; DP=2 with the distributed optimizer, untied embeddings) and one 4-rank launch runs
  TP=2 x PP=2 (actor and critic). In each: log-probs / entropy / values equal the HF model's, one update equals
  the reference (loss, grad norm, exported HF weights), and where noted save -> load -> next steps are bit-exact.
  Each layout also builds one more engine for another path: bf16 compute (TP=2), dynamic batch size with unequal
  micro-batches padded for the pipeline + a skipped non-finite step + an empty batch refused (PP=2), activation
  recompute (DP=2), and a forward-only reference policy (TP=2 x PP=2); TP=2 also checks a Llama model's log-probs.
  PP=2 and DP=2 also check exact loss aggregation (tests/backends/exactness.py: 1 vs 4 micro-batches vs dynamic
  batch sizes, to 1e-6 relative; the reference loss is a token-mean over the whole batch).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.backends.multirank import (
    assert_close,
    assert_empty_batch_refused,
    assert_step_matches_reference,
    launch,
    rank_check,
    run_checks,
)

pytestmark = pytest.mark.slow  # multi-process launches (setup.cfg: `pytest -m "not slow"` skips them)

LAYOUTS = {  # name -> (world, megatron settings, model dir, micro batch)
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), "tied", 3),
    "pp2": (2, dict(pipeline_model_parallel_size=2), "tied", 3),
    "dp2_distopt": (2, dict(use_distributed_optimizer=True), "untied", 3),
    "tp2_pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), "untied", 3),
}
CHECKS = (
    "forward",
    "train_step",
    "export_buckets",
    "critic",
    "resume_exact",
    "save_hf",
    "bf16",
    "dynamic_bsz",
    "recompute",
    "forward_only",
    "llama",
    "exact_aggregation",
)
EXACT_LAYOUTS = ("pp2", "dp2_distopt")  # tests/backends/exactness.py: PP=2 with padded micro-batches; DP=2
TOL = 1e-5


# ------------------------------------------------------------------------------------------------ mapping
def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    from tests.backends.tiny import tiny_qwen2_config

    settings = {
        k: v
        for k, v in tiny_qwen2_config().to_dict().items()
        if k
        in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "pad_token_id",
            "bos_token_id",
            "eos_token_id",
        )
    }
    return LlamaConfig(**{**settings, "tie_word_embeddings": False, **overrides})


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("kind", ["causal_lm", "value"])
def test_mapping_round_trip(arch, tied, kind):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from backends.megatron.export import export_groups
    from backends.megatron.hf_mapping import hf_to_rank, layout_from_hf, ranks_to_hf
    from tests.backends.tiny import tiny_qwen2_config

    make_config = tiny_qwen2_config if arch == "qwen2" else tiny_llama_config
    config = make_config(
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        vocab_size=99,
        num_labels=1,
    )
    torch.manual_seed(0)
    model = (AutoModelForCausalLM if kind == "causal_lm" else AutoModelForTokenClassification).from_config(config)
    hf = {k: v.detach() for k, v in model.state_dict().items()}
    assert ("model.layers.0.self_attn.q_proj.bias" in hf) == (arch == "qwen2")
    for tp in (1, 2):
        for pp in (1, 2):
            lo = layout_from_hf(config, tp, pp, kind)
            shards = {(t, s): hf_to_rank(hf, lo, t, s) for t in range(tp) for s in range(pp)}
            qkv = shards[(0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"]
            assert qkv.shape == ((4 + 2 * 2) * 16 // tp, 64)
            assert shards[(0, 0)]["embedding.word_embeddings.weight"].shape == (-(-99 // tp) * tp // tp, 64)
            back = ranks_to_hf(shards, lo)
            assert sorted(back) == sorted(hf), (tp, pp, sorted(set(hf) ^ set(back)))
            for k, v in hf.items():
                assert torch.equal(back[k], v), (tp, pp, k)
            assert [n for g in export_groups(lo, list(hf)) for n in g.hf] == list(hf)
    # the fused QKV of one group is [q heads of the group; k; v] (GQA interleave)
    lo = layout_from_hf(config, 1, 1, kind)
    fused = hf_to_rank(hf, lo, 0, 0)["decoder.layers.0.self_attention.linear_qkv.weight"]
    p = "model.layers.0.self_attn."
    assert torch.equal(fused[:32], hf[p + "q_proj.weight"][:32])
    assert torch.equal(fused[32:48], hf[p + "k_proj.weight"][:16])
    assert torch.equal(fused[48:64], hf[p + "v_proj.weight"][:16])


def test_parallel_config_validation():
    from backends.megatron.parallel import MegatronParallelConfig
    from tests.backends.tiny import tiny_qwen2_config

    cfg = MegatronParallelConfig.from_extra({"megatron": {"tensor_model_parallel_size": 2}})
    cfg.validate(4, tiny_qwen2_config())
    with pytest.raises(ValueError, match="not divisible"):
        MegatronParallelConfig.from_extra({"megatron": {"tensor_model_parallel_size": 3}}).validate(4)
    with pytest.raises(ValueError, match="heads"):
        MegatronParallelConfig(tensor_model_parallel_size=4).validate(4, tiny_qwen2_config())
    with pytest.raises(ValueError, match="num_hidden_layers"):
        MegatronParallelConfig(pipeline_model_parallel_size=4).validate(4, tiny_qwen2_config())
    with pytest.raises(ValueError, match="unknown megatron settings"):
        MegatronParallelConfig.from_extra({"megatron": {"tp": 2}})


# ------------------------------------------------------------------------------------------------ launches
def _models(work):
    from transformers import LlamaForCausalLM

    from tests.backends.tiny import save_tiny_qwen2

    save_tiny_qwen2(str(work / "tied"), seed=0, initializer_range=0.1)
    save_tiny_qwen2(str(work / "untied"), seed=1, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(2)
    LlamaForCausalLM(tiny_llama_config(initializer_range=0.1)).save_pretrained(str(work / "llama"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work2 = tmp_path_factory.mktemp("megatron_2rank")
    work4 = tmp_path_factory.mktemp("megatron_4rank")
    _models(work2)
    _models(work4)
    out = {}
    for work, world in ((work2, 2), (work4, 4)):
        (work / "layouts").write_text(",".join(n for n, v in LAYOUTS.items() if v[0] == world))
        for rank, res in launch("tests.backends.test_megatron_engine", work, world, timeout_s=300).items():
            out.setdefault(rank, {}).update(res)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout(results, layout):
    world = LAYOUTS[layout][0]
    failures = []
    for rank in range(world):
        for check in CHECKS:
            key = f"{layout}/{check}"
            if key in results[rank] and results[rank][key] is not None:
                failures.append(f"rank {rank} {key}: {results[rank][key]}")
        for check in ("forward", "train_step", "export_buckets") + (("exact_aggregation",) * (layout in EXACT_LAYOUTS)):
            assert f"{layout}/{check}" in results[rank], f"rank {rank} did not run {layout}/{check}"
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------------------ per-rank checks
def run_rank(work: str) -> None:
    run_checks(work, _run_checks)


def _run_checks(work: str, rank: int, results: dict) -> None:
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig, OptimConfig
    from tests.backends import reference as ref
    from tests.backends.exactness import check_exact_aggregation
    from tests.backends.tiny import make_batch

    Megatron = get_backend("megatron")
    optim = OptimConfig(lr=1e-3, eps=1e-3, weight_decay=0.01, grad_clip=1.0, lr_scheduler="cosine", total_steps=4)
    batch = make_batch(8, 12, 10, seed=1)

    def exported(engine, bucket_bytes=1 << 30):
        return {k: v for bucket in engine.export_weights(bucket_bytes) for k, v in bucket}

    for layout in open(os.path.join(work, "layouts")).read().split(","):
        _, settings, model_name, micro = LAYOUTS[layout]
        model_dir = os.path.join(work, model_name)
        engine_config = EngineConfig(micro_batch_size_per_gpu=micro, extra={"megatron": settings})
        engine = Megatron(ModelConfig(path=model_dir), optim, engine_config)
        dp_rank, dp_size = engine.dp_rank, engine.dp_size
        per = len(batch) // dp_size
        rows = list(range(dp_rank * per, (dp_rank + 1) * per))
        share = batch.select_idxs(rows)

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            before = ref.ref_outputs(hf, share)
        ref_loss, ref_norm = ref.ref_step(hf, batch, ref.actor_loss, ref.ref_outputs, optim)
        ref_sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}

        @rank_check(results, f"{layout}/forward")
        def _():
            out = engine.forward(share, ("log_probs", "entropy"))
            assert_close(out.batch["log_probs"], before["log_probs"], "log_probs")
            assert_close(out.batch["entropy"], before["entropy"], "entropy")
            pp_last = engine.ps.is_pipeline_last_stage()
            assert engine.collects_output == (engine.tp_rank == 0 and pp_last)

        @rank_check(results, f"{layout}/train_step")
        def _():
            metrics = engine.train_step(share, ref.actor_loss, ("log_probs", "entropy"))
            assert_step_matches_reference(metrics, metrics["loss"], exported(engine), ref_loss, ref_norm, ref_sd, optim)

        @rank_check(results, f"{layout}/export_buckets")
        def _():
            buckets = list(engine.export_weights(40_000))
            assert len(buckets) > 3
            for bucket in buckets:
                size = sum(t.numel() * t.element_size() for _, t in bucket)
                assert size <= 40_000 or len(bucket) == 1, (size, [n for n, _ in bucket])
            assert [n for bucket in buckets for n, _ in bucket] == list(ref_sd)

        extra_engine = {  # one more engine per layout, each exercising another path against the reference
            "tp2_sp": ("bf16", ModelConfig(path=model_dir), dict(mixed_precision="bfloat16")),
            "pp2": ("dynamic_bsz", ModelConfig(path=model_dir), dict(use_dynamic_bsz=True, max_token_len_per_gpu=40)),
            "dp2_distopt": ("recompute", ModelConfig(path=model_dir, gradient_checkpointing=True), {}),
            "tp2_pp2": ("forward_only", ModelConfig(path=model_dir), {}),
        }[layout]

        @rank_check(results, f"{layout}/{extra_engine[0]}")
        def _():
            name, model_config, overrides = extra_engine
            config = EngineConfig(**{"micro_batch_size_per_gpu": micro, "extra": {"megatron": settings}, **overrides})
            other = Megatron(model_config, None if name == "forward_only" else optim, config)
            out = other.forward(share, ("log_probs", "entropy")).batch
            tol = 0.1 if name == "bf16" else TOL
            assert_close(out["log_probs"], before["log_probs"], f"{name} log_probs", tol=tol)
            assert_close(out["entropy"], before["entropy"], f"{name} entropy", tol=tol)
            if name == "forward_only":
                assert not any(p.requires_grad for p in other.module.parameters())
                try:
                    other.train_step(share, ref.actor_loss)
                    raise AssertionError("train_step on a forward-only engine must fail")
                except RuntimeError:
                    pass
                return
            metrics = other.train_step(share, ref.actor_loss, ("log_probs", "entropy"))
            weights = exported(other)
            assert all(v.dtype == torch.float32 for v in weights.values())
            if name == "bf16":
                assert_close(
                    torch.tensor(metrics["grad_norm"]), torch.tensor(ref_norm), "bf16 grad_norm", tol=0.05 * ref_norm
                )
                assert max((v - ref_sd[k]).abs().max().item() for k, v in weights.items()) < 3 * optim.lr
                return
            assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(ref_norm), f"{name} grad_norm")
            for k, v in weights.items():
                assert_close(v, ref_sd[k], f"{name} weight {k}")
            if name == "dynamic_bsz":  # a non-finite gradient skips the step and leaves the weights alone
                nan = other.train_step(
                    share, lambda o, mb: (ref.actor_loss(o, mb)[0] * float("nan"), {}), ("log_probs", "entropy")
                )
                assert nan["step_skipped"] == 1.0 and other.global_step == 2, nan
                for k, v in exported(other).items():
                    assert torch.equal(v, weights[k]), k
                assert_empty_batch_refused(other, share, ref.actor_loss, ("log_probs", "entropy"))

        if layout == "tp2_sp":

            @rank_check(results, f"{layout}/llama")
            def _():  # Llama: no QKV bias, untied head, TP-sharded
                llama_dir = os.path.join(work, "llama")
                llama = Megatron(ModelConfig(path=llama_dir), None, engine_config)
                with torch.no_grad():
                    expected = ref.ref_outputs(AutoModelForCausalLM.from_pretrained(llama_dir), share)
                out = llama.forward(share, ("log_probs", "entropy")).batch
                assert_close(out["log_probs"], expected["log_probs"], "llama log_probs")
                assert_close(out["entropy"], expected["entropy"], "llama entropy")

        if layout in ("tp2_sp", "tp2_pp2"):

            @rank_check(results, f"{layout}/critic")
            def _():
                torch.manual_seed(7)
                config = AutoConfig.from_pretrained(model_dir, num_labels=1)
                config.classifier_dropout = 0.0
                critic_ref = AutoModelForTokenClassification.from_pretrained(model_dir, config=config)
                with torch.no_grad():
                    values = ref.ref_values(critic_ref, share)["values"]
                loss, norm = ref.ref_step(critic_ref, batch, ref.value_loss, ref.ref_values, optim)
                critic = Megatron(
                    ModelConfig(path=model_dir, kind="value"),
                    optim,
                    EngineConfig(micro_batch_size_per_gpu=micro, seed=7, extra={"megatron": settings}),
                )
                assert_close(critic.forward(share, ("values",)).batch["values"], values, "values")
                metrics = critic.train_step(share, ref.value_loss, ("values",))
                assert_close(torch.tensor(metrics["loss"]), torch.tensor(loss), "value loss")
                assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(norm), "value grad_norm")
                weights = exported(critic)
                assert list(weights) == list(critic_ref.state_dict())
                for k, v in weights.items():
                    assert_close(v, critic_ref.state_dict()[k], f"critic weight {k}")

        if layout in EXACT_LAYOUTS:

            @rank_check(results, f"{layout}/exact_aggregation")
            def _():  # 1 vs 4 micro-batches vs dynamic bsz against 1 process
                check_exact_aggregation(
                    lambda opt, **kw: Megatron(
                        ModelConfig(path=model_dir), opt, EngineConfig(**kw, extra={"megatron": settings})
                    ),
                    model_dir,
                    dp_rank,
                    dp_size,
                )

        if layout in ("tp2_sp", "dp2_distopt", "tp2_pp2"):

            @rank_check(results, f"{layout}/resume_exact")
            def _():
                ckpt = os.path.join(work, f"ckpt_{layout}")
                later = [make_batch(8, 12, 10, seed=s).select_idxs(rows) for s in (2, 3)]
                engine.save(ckpt)  # after step 1
                draw = torch.rand(4)
                first = [engine.train_step(b, ref.actor_loss, ("log_probs", "entropy")) for b in later]
                first_weights = exported(engine)
                fresh = Megatron(ModelConfig(path=model_dir), optim, engine_config)
                fresh.load(ckpt)
                assert torch.equal(torch.rand(4), draw), "RNG state not restored"
                assert fresh.global_step == 1
                second = [fresh.train_step(b, ref.actor_loss, ("log_probs", "entropy")) for b in later]
                for a, b in zip(first, second):
                    assert a == b, (a, b)
                assert first[1]["lr"] < first[0]["lr"] < optim.lr, first  # the cosine schedule resumed
                for k, v in exported(fresh).items():
                    assert torch.equal(v, first_weights[k]), k

        if layout == "pp2":

            @rank_check(results, f"{layout}/save_hf")
            def _():
                hf_dir = os.path.join(work, "hf_pp2")
                engine.save_hf(hf_dir)
                weights = exported(engine)
                out = engine.forward(share, ("log_probs",)).batch["log_probs"]
                if rank == 0:
                    loaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
                    assert loaded.config.architectures == ["Qwen2ForCausalLM"]
                    for k, v in loaded.state_dict().items():
                        assert torch.equal(v, weights[k]), k
                    with torch.no_grad():
                        assert_close(ref.ref_outputs(loaded, share)["log_probs"], out, "save_hf log_probs")
                dist.barrier()

        dist.barrier()
        engine.ps.destroy_model_parallel()
    dist.destroy_process_group()
