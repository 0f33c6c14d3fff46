"""The Megatron-core engine against the single-process reference (tests/backends/reference.py).

- The HF <-> Megatron mapping round trip, as pure functions (no processes), for TP 1/2 x PP 1/2, Qwen2 (QKV bias)
  and Llama, GQA, tied and untied embeddings, value heads.
- One 2-rank group serves three layouts one after the other (TP=2 with sequence parallelism; PP=2 with tied embeddings
  across stages; DP=2 with the distributed optimizer, untied embeddings) and one 4-rank group TP=2 x PP=2 (actor and
  critic) (tests/backends/rank_group.py): each test runs one check of one layout, ``check_<name>(ctx, layout)`` below,
  so ``pytest -k "pp2 and save_hf"`` runs that check and the set-up it asks for. In each: log-probs / entropy / values
  equal the HF model's, one update equals the reference (loss, grad norm, exported HF weights), and where noted save
  -> load -> next steps are bit-exact. Each layout also builds one more engine for another path: bf16 compute (TP=2),
  dynamic batch size with unequal micro-batches padded for the pipeline + a skipped non-finite step + an empty batch
  refused (PP=2), activation recompute (DP=2), and a forward-only reference policy (TP=2 x PP=2); TP=2 also checks a
  Llama model's log-probs. TP=2 (sequence parallel), PP=2 and TP=2 x PP=2 train LoRA adapters against a
  single-process PEFT step (``check_lora``). PP=2 and DP=2 also check exact loss aggregation
  (tests/backends/exactness.py: 1 vs 4 micro-batches vs dynamic batch sizes, to 1e-6 relative; the reference loss is
  a token-mean over the whole batch).
"""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tests.backends.conversion import assert_converts
from tests.backends.multirank import (
    assert_close,
    assert_empty_batch_refused,
    assert_step_matches_reference,
    counted_collectives,
)
from tests.backends.rank_group import GroupsByWorld

pytestmark = pytest.mark.slow  # multi-process groups (setup.cfg: `pytest -m "not slow"` skips them)

LAYOUTS = {  # name -> (world, megatron settings, model dir, micro batch)
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), "tied", 3),
    "pp2": (2, dict(pipeline_model_parallel_size=2), "tied", 3),
    "dp2_distopt": (2, dict(use_distributed_optimizer=True), "untied", 3),
    "tp2_pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), "untied", 3),
}
EXTRA_ENGINE = {"tp2_sp": "bf16", "pp2": "dynamic_bsz", "dp2_distopt": "recompute", "tp2_pp2": "forward_only"}
EXACT_LAYOUTS = ("pp2", "dp2_distopt")  # tests/backends/exactness.py: PP=2 with padded micro-batches; DP=2
# each layout's checks, in the order they run: a fresh engine's forward, its step, then checks of the stepped one
CHECKS = {
    layout: [
        "forward",
        "train_step",
        "export_buckets",
        EXTRA_ENGINE[layout],
        *(["llama"] if layout == "tp2_sp" else []),
        *(["critic"] if layout in ("tp2_sp", "tp2_pp2") else []),
        *(["exact_aggregation"] if layout in EXACT_LAYOUTS else []),
        *(["resume_exact"] if layout in ("tp2_sp", "dp2_distopt", "tp2_pp2") else []),
        *(["tampered_checkpoint_refused"] if layout == "tp2_sp" else []),
        *(["save_hf"] if layout == "pp2" else []),
        *(["lora"] if layout in ("tp2_sp", "pp2", "tp2_pp2") else []),
        "convert",
    ]
    for layout in LAYOUTS
}
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


def tiny_qwen3_config(**overrides):
    from scaletrain.models.tiny import tiny_config
    from tests.backends.tiny import BOS_ID, EOS_ID, PAD_ID

    return tiny_config("qwen3", overrides.pop("vocab_size"), PAD_ID, BOS_ID, EOS_ID, **overrides)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("kind", ["causal_lm", "value"])
def test_mapping_round_trip(arch, tied, kind):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from backends.megatron.export import export_groups
    from backends.megatron.hf_mapping import hf_to_rank, layout_from_hf, ranks_to_hf
    from tests.backends.tiny import tiny_qwen2_config

    make_config = {"qwen2": tiny_qwen2_config, "qwen3": tiny_qwen3_config, "llama": tiny_llama_config}[arch]
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
            shards = {(t, s, 0): hf_to_rank(hf, lo, t, s) for t in range(tp) for s in range(pp)}
            qkv = shards[(0, 0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"]
            q_norm = shards[(tp - 1, 0, 0)].get("decoder.layers.0.self_attention.q_layernorm.weight")  # Qwen3's, whole
            assert (q_norm is not None) == (arch == "qwen3")
            assert q_norm is None or torch.equal(q_norm, hf["model.layers.0.self_attn.q_norm.weight"])
            assert qkv.shape == ((4 + 2 * 2) * 16 // tp, 64)
            assert shards[(0, 0, 0)]["embedding.word_embeddings.weight"].shape == (-(-99 // tp) * tp // tp, 64)
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


# ------------------------------------------------------------------------------------------------ the groups
def _models(work):
    from transformers import LlamaForCausalLM

    from tests.backends.tiny import save_tiny_qwen2

    save_tiny_qwen2(str(work / "tied"), seed=0, initializer_range=0.1)
    save_tiny_qwen2(str(work / "untied"), seed=1, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(2)
    LlamaForCausalLM(tiny_llama_config(initializer_range=0.1)).save_pretrained(str(work / "llama"))


@pytest.fixture(scope="module")
def group_of(tmp_path_factory):
    """``group_of(world)``: the serving group of that many ranks (2 or 4), started when a check of its layouts first
    runs; the other world size's group ends first (one group's memory at a time)."""
    work = tmp_path_factory.mktemp("megatron")
    _models(work)
    groups = GroupsByWorld("tests.backends.test_megatron_engine", work)
    yield groups
    groups.close()


@pytest.mark.parametrize("layout, check", [(layout, check) for layout, checks in CHECKS.items() for check in checks])
def test_layout(group_of, layout, check):
    group_of(LAYOUTS[layout][0]).assert_passed(check, layout)


# ---------------------------------------------------------------------------------- set-up the checks share
OFFLOAD_ALL = dict(param_offload=True, grad_offload=True, optimizer_offload=True)


def exported(engine, bucket_bytes=1 << 30):
    return {k: v for bucket in engine.export_weights(bucket_bytes) for k, v in bucket}


def assert_offloaded(engine):
    """Between calls, an engine offloading everything holds no bytes in its parameters, their gradient buffers
    (``main_grad``) or its optimizer's parameters and state (read from megatron's own objects)."""
    held = {}
    for name, p in engine.module.named_parameters():
        held[name] = p.untyped_storage().nbytes()
        if getattr(p, "main_grad", None) is not None:
            held[f"{name}.main_grad"] = p.main_grad.untyped_storage().nbytes()
    optimizers = [] if engine.optimizer is None else [engine.optimizer]
    for i, part in enumerate(getattr(engine.optimizer, "chained_optimizers", optimizers)):
        for j, p in enumerate(q for group in part.optimizer.param_groups for q in group["params"]):
            held[f"optimizer {i} param {j}"] = p.untyped_storage().nbytes()
            for key, value in part.optimizer.state.get(p, {}).items():
                if key != "step":
                    held[f"optimizer {i} param {j} {key}"] = value.untyped_storage().nbytes()
    left = [f"{name}: {n} bytes" for name, n in held.items() if n]
    assert held and not left, f"{len(left)} of {len(held)} still hold bytes: {left[:4]}"


def layout_state(ctx, layout):
    """The layout's engine (fresh), this DP rank's rows and the single-process reference step on the whole batch.
    Megatron's parallel state is one per process: entering a layout ends the previous one's, which cannot come back
    (its checks run together, in ``CHECKS``' order)."""
    active = ctx.once("active", lambda: {"layout": None, "ended": set()})
    if layout in active["ended"]:
        raise RuntimeError(f"layout {layout} was left for another one: run a layout's checks together")
    if active["layout"] not in (None, layout):
        ctx.once(active["layout"], lambda: None).engine.ps.destroy_model_parallel()
        active["ended"].add(active["layout"])
    active["layout"] = layout
    return ctx.once(layout, lambda: _layout_state(ctx, layout))


def _layout_state(ctx, layout):
    from transformers import AutoModelForCausalLM

    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig, OptimConfig
    from tests.backends import reference as ref
    from tests.backends.tiny import make_batch

    Megatron = get_backend("megatron")
    optim = OptimConfig(lr=1e-3, eps=1e-3, weight_decay=0.01, grad_clip=1.0, lr_scheduler="cosine", total_steps=4)
    batch = make_batch(8, 12, 10, seed=1)
    _, settings, model_name, micro = LAYOUTS[layout]
    model_dir = os.path.join(ctx.inputs, model_name)
    engine_config = EngineConfig(micro_batch_size_per_gpu=micro, extra={"megatron": settings})
    engine = Megatron(ModelConfig(path=model_dir), optim, engine_config)
    per = len(batch) // engine.dp_size
    rows = list(range(engine.dp_rank * per, (engine.dp_rank + 1) * per))
    share = batch.select_idxs(rows)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        before = ref.ref_outputs(hf, share)
    ref_loss, ref_norm = ref.ref_step(hf, batch, ref.actor_loss, ref.ref_outputs, optim)
    return SimpleNamespace(
        Megatron=Megatron,
        optim=optim,
        batch=batch,
        settings=settings,
        micro=micro,
        model_dir=model_dir,
        engine_config=engine_config,
        engine=engine,
        rows=rows,
        share=share,
        before=before,
        ref_loss=ref_loss,
        ref_norm=ref_norm,
        ref_sd={k: v.detach().clone() for k, v in hf.state_dict().items()},
    )


def stepped(ctx, layout):
    """The layout's engine after its one step on this DP rank's rows, which must equal the reference step."""

    def step():
        from tests.backends import reference as ref

        s = layout_state(ctx, layout)
        metrics = s.engine.train_step(s.share, ref.actor_loss, ("log_probs", "entropy"))
        weights = exported(s.engine)
        assert_step_matches_reference(metrics, metrics["loss"], weights, s.ref_loss, s.ref_norm, s.ref_sd, s.optim)
        return s.engine

    layout_state(ctx, layout)  # enters the layout
    return ctx.once(f"{layout}/stepped", step)


# ------------------------------------------------------------------------------------------ per-rank checks
def check_forward(ctx, layout):
    s = layout_state(ctx, layout)
    assert s.engine.global_step == 0, "the layout's engine has stepped already: run its checks in order"
    pp_last = s.engine.ps.is_pipeline_last_stage()
    head_outputs = []  # the LM head's logits: (positions, rows, V/tp) per micro-batch, the response's only
    head = s.engine.module.output_layer if pp_last else None  # earlier pipeline stages have no head
    hook = head.register_forward_hook(lambda m, a, out: head_outputs.append(out[0].shape)) if head else None
    try:
        out = s.engine.forward(s.share, ("log_probs", "entropy", "sum_pi_squared"))
    finally:
        if hook is not None:
            hook.remove()
    for name in ("log_probs", "entropy", "sum_pi_squared"):  # TP: each over the vocabulary slices of the ranks
        assert_close(out.batch[name], s.before[name], name)
    R = s.share.batch["responses"].shape[1]
    assert not pp_last or (head_outputs and {shape[0] for shape in head_outputs} == {R}), (head_outputs, R)
    assert s.engine.collects_output == (s.engine.tp_rank == 0 and pp_last)


def check_train_step(ctx, layout):
    stepped(ctx, layout)  # its step is the check


def check_export_buckets(ctx, layout):
    """Buckets within their size, every HF name once, and a decoder layer's bytes in one collective: the stages'
    layers of one local index by one all-gather over the TP x PP ranks (none with TP = PP = 1); only the
    embedding, final norm and head are broadcast over PP (one broadcast each) or gathered over TP."""
    engine, s = stepped(ctx, layout), layout_state(ctx, layout)
    with counted_collectives("all_gather_into_tensor", "broadcast", "all_gather") as calls:
        buckets = list(engine.export_weights(40_000))
    assert len(buckets) > 3
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 40_000 or len(bucket) == 1, (size, [n for n, _ in bucket])
    names = [n for bucket in buckets for n, _ in bucket]
    assert sorted(names) == sorted(s.ref_sd) and len(names) == len(set(names)), names
    lo, others = engine.layout, [n for n in s.ref_sd if not n.startswith("model.layers.")]
    assert calls["all_gather_into_tensor"] == (lo.layers_per_stage if lo.tp * lo.pp > 1 else 0), calls
    assert calls["broadcast"] == (len(others) if lo.pp > 1 else 0), (calls, others)
    assert calls["all_gather"] <= len(others), calls


def _extra_engine(ctx, layout):
    """One more engine per layout, each exercising another path against the reference: its forward, and for all
    but the forward-only one its step; returns (engine, the step's metrics, its exported weights)."""
    from backends.config import EngineConfig, ModelConfig
    from tests.backends import reference as ref

    s, name = layout_state(ctx, layout), EXTRA_ENGINE[layout]
    model_config, overrides = {
        "bf16": (ModelConfig(path=s.model_dir), dict(mixed_precision="bfloat16", **OFFLOAD_ALL)),
        "dynamic_bsz": (ModelConfig(path=s.model_dir), dict(use_dynamic_bsz=True, max_token_len_per_gpu=40)),
        "recompute": (ModelConfig(path=s.model_dir, enable_gradient_checkpointing=True), {}),
        "forward_only": (ModelConfig(path=s.model_dir), OFFLOAD_ALL),  # the flags a ref may set: no optimizer
    }[name]
    config = EngineConfig(**{"micro_batch_size_per_gpu": s.micro, "extra": {"megatron": s.settings}, **overrides})
    other = s.Megatron(model_config, None if name == "forward_only" else s.optim, config)
    out = other.forward(s.share, ("log_probs", "entropy")).batch
    tol = 0.1 if name == "bf16" else TOL
    assert_close(out["log_probs"], s.before["log_probs"], f"{name} log_probs", tol=tol)
    assert_close(out["entropy"], s.before["entropy"], f"{name} entropy", tol=tol)
    if name == "forward_only":
        return other, None, None
    metrics = other.train_step(s.share, ref.actor_loss, ("log_probs", "entropy"))
    weights = exported(other)
    assert all(v.dtype == torch.float32 for v in weights.values())
    return other, metrics, weights


def check_bf16(ctx, layout):
    """bf16 compute, with every offload on (bf16's float32 main weights are the optimizer's own storage)."""
    s = layout_state(ctx, layout)
    other, metrics, weights = _extra_engine(ctx, layout)
    assert_offloaded(other)
    assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(s.ref_norm), "bf16 grad_norm", tol=0.05 * s.ref_norm)
    assert max((v - s.ref_sd[k]).abs().max().item() for k, v in weights.items()) < 3 * s.optim.lr


def _matches_reference(ctx, layout):
    """The extra engine's step equals the reference step: grad norm and every exported weight."""
    s, name = layout_state(ctx, layout), EXTRA_ENGINE[layout]
    other, metrics, weights = _extra_engine(ctx, layout)
    assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(s.ref_norm), f"{name} grad_norm")
    for k, v in weights.items():
        assert_close(v, s.ref_sd[k], f"{name} weight {k}")
    return other, weights


def check_recompute(ctx, layout):
    _matches_reference(ctx, layout)


def check_dynamic_bsz(ctx, layout):
    """Unequal micro-batches padded for the pipeline; then a non-finite gradient skips the step and leaves the
    weights alone, and an empty batch is refused."""
    from tests.backends import reference as ref

    s = layout_state(ctx, layout)
    other, weights = _matches_reference(ctx, layout)
    nan = other.train_step(
        s.share, lambda o, mb: (ref.actor_loss(o, mb)[0] * float("nan"), {}), ("log_probs", "entropy")
    )
    assert nan["step_skipped"] == 1.0 and other.global_step == 2, nan
    for k, v in exported(other).items():
        assert torch.equal(v, weights[k]), k
    assert_empty_batch_refused(other, s.share, ref.actor_loss, ("log_probs", "entropy"))


def check_forward_only(ctx, layout):
    from tests.backends import reference as ref

    other, _, _ = _extra_engine(ctx, layout)
    assert not any(p.requires_grad for p in other.module.parameters())
    assert_offloaded(other)
    try:
        other.train_step(layout_state(ctx, layout).share, ref.actor_loss)
        raise AssertionError("train_step on a forward-only engine must fail")
    except RuntimeError:
        pass
    assert_offloaded(other)


def check_llama(ctx, layout):
    """Llama: no QKV bias, untied head, TP-sharded."""
    from transformers import AutoModelForCausalLM

    from backends.config import ModelConfig
    from tests.backends import reference as ref

    s = layout_state(ctx, layout)
    llama_dir = os.path.join(ctx.inputs, "llama")
    llama = s.Megatron(ModelConfig(path=llama_dir), None, s.engine_config)
    with torch.no_grad():
        expected = ref.ref_outputs(AutoModelForCausalLM.from_pretrained(llama_dir), s.share)
    out = llama.forward(s.share, ("log_probs", "entropy")).batch
    assert_close(out["log_probs"], expected["log_probs"], "llama log_probs")
    assert_close(out["entropy"], expected["entropy"], "llama entropy")


def check_critic(ctx, layout):
    from transformers import AutoConfig, AutoModelForTokenClassification

    from backends.config import EngineConfig, ModelConfig
    from tests.backends import reference as ref

    s = layout_state(ctx, layout)
    torch.manual_seed(7)
    config = AutoConfig.from_pretrained(s.model_dir, num_labels=1)
    config.classifier_dropout = 0.0
    critic_ref = AutoModelForTokenClassification.from_pretrained(s.model_dir, config=config)
    with torch.no_grad():
        values = ref.ref_values(critic_ref, s.share)["values"]
    loss, norm = ref.ref_step(critic_ref, s.batch, ref.value_loss, ref.ref_values, s.optim)
    critic = s.Megatron(
        ModelConfig(path=s.model_dir, kind="value"),
        s.optim,
        EngineConfig(micro_batch_size_per_gpu=s.micro, seed=7, extra={"megatron": s.settings}),
    )
    assert_close(critic.forward(s.share, ("values",)).batch["values"], values, "values")
    metrics = critic.train_step(s.share, ref.value_loss, ("values",))
    assert_close(torch.tensor(metrics["loss"]), torch.tensor(loss), "value loss")
    assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(norm), "value grad_norm")
    weights = exported(critic)
    assert list(weights) == list(critic_ref.state_dict())
    for k, v in weights.items():
        assert_close(v, critic_ref.state_dict()[k], f"critic weight {k}")
    assert_converts(critic, s.share, os.path.join(ctx.work, f"convert_critic_{layout}"), ctx.rank, kind="value")


def check_exact_aggregation(ctx, layout):
    """1 vs 4 micro-batches vs dynamic bsz against 1 process (tests/backends/exactness.py)."""
    from backends.config import EngineConfig, ModelConfig
    from tests.backends.exactness import check_exact_aggregation

    s = layout_state(ctx, layout)
    check_exact_aggregation(
        lambda opt, **kw: s.Megatron(
            ModelConfig(path=s.model_dir), opt, EngineConfig(**kw, extra={"megatron": s.settings})
        ),
        s.model_dir,
        s.engine.dp_rank,
        s.engine.dp_size,
    )


def check_resume_exact(ctx, layout):
    from backends.config import ModelConfig
    from tests.backends import reference as ref
    from tests.backends.tiny import make_batch

    engine, s = stepped(ctx, layout), layout_state(ctx, layout)
    ckpt = os.path.join(ctx.work, f"ckpt_{layout}")
    later = [make_batch(8, 12, 10, seed=seed).select_idxs(s.rows) for seed in (2, 3)]
    engine.save(ckpt)  # after step 1
    draw = torch.rand(4)
    engine.offload()  # what the colocated rollout calls: every state off the device, then back
    assert_offloaded(engine)
    engine.onload()
    first = [engine.train_step(b, ref.actor_loss, ("log_probs", "entropy")) for b in later]
    first_weights = exported(engine)
    # the resumed engine offloads everything between calls: its steps must still equal the first engine's
    fresh = s.Megatron(ModelConfig(path=s.model_dir), s.optim, replace(s.engine_config, **OFFLOAD_ALL))
    fresh.load(ckpt)
    assert torch.equal(torch.rand(4), draw), "RNG state not restored"
    assert fresh.global_step == 1
    assert_offloaded(fresh)
    second = []
    for b in later:
        second.append(fresh.train_step(b, ref.actor_loss, ("log_probs", "entropy")))
        assert_offloaded(fresh)
    for a, b in zip(first, second):
        assert a == b, (a, b)
    assert first[1]["lr"] < first[0]["lr"] < s.optim.lr, first  # the cosine schedule resumed
    for k, v in exported(fresh).items():
        assert torch.equal(v, first_weights[k]), k


def check_tampered_checkpoint_refused(ctx, layout):
    """Each rank's checkpoint file carrying a pickled call: loading fails naming the file before anything of the
    engine changes, and the call never ran (tests/backends/tampering.py)."""
    from tests.backends import tampering as t

    engine = stepped(ctx, layout)
    path, marker = t.copy_checkpoint(engine, ctx.work, f"tampered_{layout}")
    rank_file = os.path.join(path, f"rank{ctx.rank}.pt")
    t.inject_into_torch_file(rank_file, marker)
    t.assert_refused(lambda: engine.load(path), [rank_file], marker)


def check_save_hf(ctx, layout):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from tests.backends import reference as ref

    engine, s = stepped(ctx, layout), layout_state(ctx, layout)
    hf_dir = os.path.join(ctx.work, f"hf_{layout}")
    engine.save_hf(hf_dir)
    weights = exported(engine)
    out = engine.forward(s.share, ("log_probs",)).batch["log_probs"]
    if ctx.rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        assert loaded.config.architectures == ["Qwen2ForCausalLM"]
        for k, v in loaded.state_dict().items():
            assert torch.equal(v, weights[k]), k
        with torch.no_grad():
            assert_close(ref.ref_outputs(loaded, s.share)["log_probs"], out, "save_hf log_probs")
    dist.barrier()


def check_convert(ctx, layout):
    """The checkpoint of the stepped engine converted offline (tests/backends/conversion.py): each TP shard and PP
    stage of DP rank 0 mapped back to the HF tensors."""
    engine, s = stepped(ctx, layout), layout_state(ctx, layout)
    assert_converts(engine, s.share, os.path.join(ctx.work, f"convert_{layout}"), ctx.rank)


def _trained_adapter(ctx, model_dir: str) -> str:
    """A PEFT adapter directory with random A and B (PEFT's fresh B is zero, which would leave A's gradient untested),
    the same on every rank (seeded; each rank writes its own copy)."""
    from tests.backends import lora_checks as lc

    path = os.path.join(ctx.work, f"adapter_rank{ctx.rank}")
    if not os.path.isdir(path):
        peft = lc.peft_reference(model_dir)
        torch.manual_seed(5)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0.0, 0.05)
        peft.save_pretrained(path)
    return path


def check_lora(ctx, layout):
    """LoRA on megatron (backends/megatron/lora.py) against a single-process PEFT reference step from the same trained
    adapter (tests/backends/lora_checks.py: torch AdamW on the adapters): loss, grad norm and every adapter after the
    step; only the adapters train; the merged export equals PEFT's merge_and_unload; the base-model forward (adapters
    off) is the HF model's before and after the step; the adapter directory of save_hf loads in PEFT with the trained
    adapters; save -> load -> the next step is bit-exact."""
    import copy

    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from backends.config import ForwardOptions
    from tests.backends import lora_checks as lc
    from tests.backends import reference as ref
    from tests.backends.tiny import make_batch

    s = layout_state(ctx, layout)
    adapter_dir = _trained_adapter(ctx, s.model_dir)
    base = AutoModelForCausalLM.from_pretrained(s.model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    loss, norm = lc.adapter_step(peft, s.batch, ref.actor_loss, ref.ref_outputs, s.optim)
    ref_adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft).items()}
    merged = copy.deepcopy(peft).merge_and_unload().state_dict()
    model_config = lc.lora_model_config(s.model_dir, lora_adapter_path=adapter_dir)
    engine = s.Megatron(model_config, s.optim, s.engine_config)
    base_model = ForwardOptions(base_model=True)

    metrics = engine.train_step(s.share, ref.actor_loss, ("log_probs", "entropy"))
    assert_close(torch.tensor(metrics["loss"]), torch.tensor(loss), "lora loss")
    assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(norm), "lora grad_norm")
    adapter = {k: v for bucket in engine.export_adapter(4096) for k, v in bucket}
    assert list(adapter) == list(ref_adapter), "adapter names differ from PEFT's"
    assert engine.adapter_bytes() == sum(v.numel() * v.element_size() for v in adapter.values())
    for k, v in adapter.items():
        assert_close(v, ref_adapter[k], f"adapter {k}")
    trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    weights = exported(engine)
    assert list(weights) == list(merged)
    for k, v in weights.items():
        assert_close(v, merged[k], f"merged {k}")
    after = engine.forward(s.share, ("log_probs",), base_model).batch["log_probs"]
    assert_close(after, s.before["log_probs"], "base-model log_probs after the step")

    hf_dir = os.path.join(ctx.work, f"lora_hf_{layout}")
    engine.save_hf(hf_dir)
    if ctx.rank == 0:
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(s.model_dir), hf_dir)
        saved = get_peft_model_state_dict(loaded)
        assert list(saved) == list(ref_adapter)
        for k, v in saved.items():
            assert_close(v, ref_adapter[k], f"saved adapter {k}")

    ckpt = os.path.join(ctx.work, f"lora_ckpt_{layout}")
    engine.save(ckpt)
    later = make_batch(8, 12, 10, seed=2).select_idxs(s.rows)
    first = engine.train_step(later, ref.actor_loss, ("log_probs", "entropy"))
    fresh = s.Megatron(model_config, s.optim, s.engine_config)
    fresh.load(ckpt)
    second = fresh.train_step(later, ref.actor_loss, ("log_probs", "entropy"))
    assert first == second, (first, second)
    again = {k: v for bucket in fresh.export_adapter() for k, v in bucket}
    for k, v in {k: v for bucket in engine.export_adapter() for k, v in bucket}.items():
        assert torch.equal(v, again[k]), k
