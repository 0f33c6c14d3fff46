"""Every training backend on a real pretrained model, SmolLM2-135M-Instruct (Llama: GQA 9 / 3 heads, head_dim 64,
tied embeddings, no biases, rope_theta 1e5, vocabulary 49152), against plain HF transformers (one process, fp32,
eager attention), on one batch of real chat text (the model's tokenizer and chat template).

- Reference, once in the test process: per-token log-probs / entropy of the batch, and the loss and gradient norm
  of one actor-loss step (tests/backends/reference.py).
- One group of ranks per backend, serving its checks one test each (tests/backends/rank_group.py; a process holds
  one engine, and a backend's group ends before the next one's starts, so the peak memory is one engine's): FSDP2,
  DeepSpeed ZeRO-3 and Megatron PP=2 on 2 ranks, Megatron TP=3 on 3 ranks. Megatron cannot split 9 query heads /
  3 KV heads over TP=2 (the engine refuses it, checked below without a launch), so TP=3 is the tensor-parallel
  layout of this model.
- Per backend: forward log-probs equal the reference (<= 1e-4; entropy <= 2e-4); one train step (lr 1e-5) gives the
  reference loss and gradient norm; after it, save_hf -> ``from_pretrained`` gives every tensor bit-equal to the
  engine's export, and the reloaded model's log-probs equal the engine's own post-step log-probs (<= 1e-4), which
  differ from the pre-step ones by far more than that (the step is really in the export).
- Without a launch: the Megatron mapping on a SmolLM2-shaped tiny Llama (3 query groups over TP=3, vocabulary padded
  to a TP multiple, PP=2), RoPE settings equal to HF's rotary embedding, clear errors for configs that do not map.

Each rank writes its measured differences and peak memory to ``figures_rank{R}.json``; ``test_backend`` prints them
after a backend's last check (``-s``).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from tests.backends.multirank import assert_close
from tests.backends.rank_group import RankGroup

TOL = 1e-4
ENTROPY_TOL = 2e-4  # entropy sums p * log p over 49152 tokens: measured up to 8.7e-5 (log-probs up to 3.1e-5)
LR = 1e-5
SYSTEM = "You are a concise assistant."
CONVERSATIONS = [  # (user, assistant): the prompt goes through the chat template, the response ends with <|im_end|>
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name a prime number larger than ten.", "Eleven is a prime number larger than ten."),
    ("Say hello in Spanish.", "Hola!"),
    ("Give me a synonym of quick.", "A synonym of quick is fast, as in a fast car."),
]
WORLD = {"fsdp": 2, "deepspeed": 2, "megatron_pp2": 2, "megatron_tp3": 3}  # backend -> ranks of its launch
MEGATRON = {"megatron_pp2": {"pipeline_model_parallel_size": 2}, "megatron_tp3": {"tensor_model_parallel_size": 3}}
CHECKS = ("forward", "train_step", "export_reload")


# ------------------------------------------------------------------------------------------------ the batch
def chat_batch(model_dir: str):
    """The CONVERSATIONS in verl's layout: prompts (system + user, generation prompt) left-padded, responses
    right-padded, plus fixed advantages for the actor loss."""
    from transformers import AutoTokenizer

    from scaletrain.protocol import DataProto

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts, responses = [], []
    for user, answer in CONVERSATIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False).input_ids)
        responses.append(tok(answer + tok.eos_token, add_special_tokens=False).input_ids)
    P, R, pad = max(map(len, prompts)), max(map(len, responses)), tok.pad_token_id
    ids = torch.full((len(prompts), P + R), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p) : P], ids[i, P : P + len(r)] = torch.tensor(p), torch.tensor(r)
        mask[i, P - len(p) : P + len(r)] = 1
    resp_mask = mask[:, P:].clone()
    advantages = torch.linspace(-1.0, 1.0, len(prompts) * R).view(len(prompts), R) * resp_mask
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, P:].clone(),
            "response_mask": resp_mask,
            "prompts": ids[:, :P].clone(),
            "advantages": advantages,
            "old_log_probs": torch.zeros(len(prompts), R),
        },
        meta_info={"temperature": 1.0},
    )


def load_reference_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")


def write_reference(model_dir: str, path: str) -> None:
    """Reference outputs before the step, and the step's loss and (pre-clipping) gradient norm."""
    from tests.backends import reference as ref

    batch = chat_batch(model_dir)
    model = load_reference_model(model_dir)
    with torch.no_grad():
        before = ref.ref_outputs(model, batch)
    loss, _ = ref.actor_loss(ref.ref_outputs(model, batch), batch)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    torch.save({**before, "loss": float(loss), "grad_norm": float(norm)}, path)


# ------------------------------------------------------------------------------------------------ the groups
@pytest.fixture(scope="module")
def reference_path(smollm2_dir, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("smollm2_reference") / "reference.pt")
    write_reference(smollm2_dir, path)
    gc.collect()
    return path


@pytest.fixture(scope="module")
def backend_group(smollm2_dir, reference_path, tmp_path_factory):
    """``backend_group(backend)``: that backend's serving group; the previous backend's ends first."""
    work = tmp_path_factory.mktemp("parity")
    (work / "settings.json").write_text(json.dumps({"model_dir": smollm2_dir, "reference": reference_path}))
    groups: dict[str, RankGroup] = {}

    def group(backend: str) -> RankGroup:
        for other in [b for b in groups if b != backend]:
            groups.pop(other).close()
        if backend not in groups:
            groups[backend] = RankGroup("tests.backends.test_real_model_parity", work, WORLD[backend], timeout_s=600)
        return groups[backend]

    yield group
    for g in groups.values():
        g.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend, check", [(backend, check) for backend in WORLD for check in CHECKS])
def test_backend(backend, check, backend_group):
    if backend != "fsdp":
        pytest.importorskip("megatron.core" if backend in MEGATRON else backend)
    group = backend_group(backend)
    group.assert_passed(check, backend)
    if check == CHECKS[-1]:
        figures = {r: json.loads((group.run_dir / f"figures_rank{r}.json").read_text()) for r in range(group.world)}
        print(f"\n{backend}: {json.dumps(figures)}")


# ---------------------------------------------------------------------------------- set-up the checks share
def engine_state(ctx, backend: str):
    """The backend's engine on the model, this DP rank's rows, the reference and the figures measured so far."""

    def build():
        settings = json.loads(open(os.path.join(ctx.inputs, "settings.json")).read())
        reference = torch.load(settings["reference"])
        batch = chat_batch(settings["model_dir"])
        engine = _build_engine(backend, settings["model_dir"])
        per = len(batch) // engine.dp_size
        rows = list(range(engine.dp_rank * per, (engine.dp_rank + 1) * per))
        before = {k: reference[k][rows] for k in ("log_probs", "entropy")}
        return SimpleNamespace(engine=engine, share=batch.select_idxs(rows), before=before, reference=reference)

    return ctx.once(backend, build)


def _build_engine(backend: str, model_dir: str):
    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig, OptimConfig

    extra = {"megatron": MEGATRON[backend]} if backend in MEGATRON else {}
    config = EngineConfig(micro_batch_size_per_gpu=2, extra=extra)
    engine_class = get_backend("megatron" if backend in MEGATRON else backend)
    return engine_class(ModelConfig(path=model_dir), OptimConfig(lr=LR, grad_clip=1.0), config)


def record(ctx, **figures) -> None:
    """Adds to this rank's ``figures_rank{R}.json`` (with the peak memory so far)."""
    import resource

    path = os.path.join(ctx.work, f"figures_rank{ctx.rank}.json")
    known = json.loads(open(path).read()) if os.path.exists(path) else {}
    known.update(figures, peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    with open(path, "w") as f:
        json.dump(known, f)


def stepped(ctx, backend: str):
    """The engine after its one train step, which must give the reference loss and gradient norm."""

    def step():
        import torch.distributed as dist

        from tests.backends import reference as ref

        s = engine_state(ctx, backend)
        metrics = s.engine.train_step(s.share, ref.actor_loss, ("log_probs", "entropy"))
        loss = torch.tensor([metrics["loss"]], dtype=torch.float64)
        dist.all_reduce(loss)  # every rank reports the whole batch's loss (backends/accumulation.py): so does the mean
        loss = float(loss) / dist.get_world_size()
        record(ctx, loss_diff=abs(loss - s.reference["loss"]), grad_norm=metrics["grad_norm"])
        record(ctx, ref_grad_norm=s.reference["grad_norm"])
        assert metrics["lr"] == LR and metrics["step_skipped"] == 0.0, metrics
        assert abs(loss - s.reference["loss"]) <= TOL, (loss, s.reference["loss"])
        assert abs(metrics["grad_norm"] - s.reference["grad_norm"]) <= TOL * s.reference["grad_norm"], (
            metrics["grad_norm"],
            s.reference["grad_norm"],
        )
        return s.engine

    return ctx.once(f"{backend}/stepped", step)


# ------------------------------------------------------------------------------------------ per-rank checks
def check_forward(ctx, backend: str) -> None:
    s = engine_state(ctx, backend)
    assert s.engine.global_step == 0, "the engine has stepped already: run the checks in CHECKS' order"
    out = s.engine.forward(s.share, ("log_probs", "entropy")).batch
    record(ctx, forward_log_probs_max_diff=_max_diff(out["log_probs"], s.before["log_probs"]))
    record(ctx, forward_entropy_max_diff=_max_diff(out["entropy"], s.before["entropy"]))
    assert_close(out["log_probs"], s.before["log_probs"], "log_probs", tol=TOL)
    assert_close(out["entropy"], s.before["entropy"], "entropy", tol=ENTROPY_TOL)


def check_train_step(ctx, backend: str) -> None:
    stepped(ctx, backend)  # its step is the check


def check_export_reload(ctx, backend: str) -> None:
    engine, s = stepped(ctx, backend), engine_state(ctx, backend)
    figures: dict = {}
    try:
        _check_export_reload(engine, os.path.join(ctx.work, "hf"), ctx.rank, s.share, s.before, figures)
    finally:
        record(ctx, **figures)


def _check_export_reload(engine, hf_dir, rank, share, before, figures) -> None:
    """save_hf after the step -> from_pretrained: the engine's exported tensors bit for bit (compared bucket by
    bucket on rank 0, so no rank holds a second full copy), and the engine's own post-step log-probs."""
    import torch.distributed as dist

    from tests.backends import reference as ref

    after = engine.forward(share, ("log_probs",)).batch["log_probs"]
    figures["step_log_probs_change"] = _max_diff(after, before["log_probs"])
    assert figures["step_log_probs_change"] > 20 * TOL, "the step left the log-probs (nearly) unchanged"
    engine.save_hf(hf_dir)
    loaded = load_reference_model(hf_dir) if rank == 0 else None
    state = loaded.state_dict() if loaded is not None else {}
    exported, unequal = [], []
    for bucket in engine.export_weights(64 << 20):  # collective: every rank iterates
        for name, tensor in bucket:
            exported.append(name)
            if loaded is not None and not (name in state and torch.equal(state[name], tensor)):
                unequal.append(name)
    if loaded is not None:
        assert loaded.config.architectures == ["LlamaForCausalLM"] and loaded.config.tie_word_embeddings
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        assert sorted(state) == sorted(exported), sorted(set(state) ^ set(exported))
        assert not unequal, f"reloaded tensors differ from the engine's export: {unequal[:5]}"
        with torch.no_grad():
            reloaded = ref.ref_outputs(loaded, share)["log_probs"]
        figures["reload_log_probs_max_diff"] = _max_diff(reloaded, after)
        assert_close(reloaded, after, "reloaded log_probs", tol=TOL)
        del loaded, state
        shutil.rmtree(hf_dir)
    dist.barrier()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ------------------------------------------------------------------------------------- mapping, no launch
def smollm2_shaped_llama(**overrides):
    """A tiny Llama config shaped like SmolLM2: 9 query heads in 3 groups, tied embeddings, no biases, rope 1e5,
    and a vocabulary (100) that TP=3 must pad."""
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=100,
        hidden_size=72,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        max_position_embeddings=256,
    )
    return LlamaConfig(**{**settings, **overrides})


@pytest.mark.parametrize("kind, head_dim", [("causal_lm", 8), ("value", 8), ("causal_lm", 16)])
def test_mapping_smollm2_shape(kind, head_dim):
    """Round trip for TP 1 / 3 x PP 1 / 2; head_dim 16 is an explicit head_dim != hidden / heads (8)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from backends.megatron.export import export_groups
    from backends.megatron.hf_mapping import hf_to_rank, layout_from_hf, ranks_to_hf

    config = smollm2_shaped_llama(num_labels=1, head_dim=head_dim)
    torch.manual_seed(0)
    model = (AutoModelForCausalLM if kind == "causal_lm" else AutoModelForTokenClassification).from_config(config)
    hf = {k: v.detach() for k, v in model.state_dict().items()}
    for tp in (1, 3):
        for pp in (1, 2):
            lo = layout_from_hf(config, tp, pp, kind)
            shards = {(t, s, 0): hf_to_rank(hf, lo, t, s) for t in range(tp) for s in range(pp)}
            back = ranks_to_hf(shards, lo)
            assert sorted(back) == sorted(hf), (tp, pp, sorted(set(hf) ^ set(back)))
            assert all(torch.equal(back[k], v) for k, v in hf.items()), (tp, pp)
            assert [n for g in export_groups(lo, list(hf)) for n in g.hf] == list(hf)
    lo = layout_from_hf(config, 3, 1, kind)
    assert (lo.head_dim, lo.num_kv_heads, lo.padded_vocab) == (head_dim, 3, 102)
    p, q, kv = "model.layers.0.self_attn.", 3 * head_dim, head_dim
    for t in range(3):  # TP rank t holds query group t: its 3 query heads, then its key head and value head
        rank = hf_to_rank(hf, lo, t, 0)
        qkv = rank["decoder.layers.0.self_attention.linear_qkv.weight"]
        expected = [
            hf[p + "q_proj.weight"][q * t : q * (t + 1)],
            hf[p + "k_proj.weight"][kv * t : kv * (t + 1)],
            hf[p + "v_proj.weight"][kv * t : kv * (t + 1)],
        ]
        assert torch.equal(qkv, torch.cat(expected))
        assert "decoder.layers.0.self_attention.linear_qkv.bias" not in rank
        embed = rank["embedding.word_embeddings.weight"]
        assert embed.shape == (34, 72)
        real = hf["model.embed_tokens.weight"][34 * t : 34 * t + 34]
        assert torch.equal(embed[: len(real)], real) and not embed[len(real) :].any()  # zero padding rows


def test_smollm2_layout(smollm2_dir):
    """The real config maps (no weights loaded); 9 / 3 heads do not split over TP=2, they do over TP=3."""
    from transformers import AutoConfig

    from backends.megatron.hf_mapping import layout_from_hf, rope_settings
    from backends.megatron.parallel import MegatronParallelConfig

    config = AutoConfig.from_pretrained(smollm2_dir)
    lo = layout_from_hf(config, 3, 2)
    assert (lo.num_heads, lo.num_kv_heads, lo.head_dim, lo.vocab_size, lo.padded_vocab, lo.tie_embeddings) == (
        9,
        3,
        64,
        49152,
        49152,
        True,
    )
    assert rope_settings(config) == {"rotary_base": 100000.0}
    MegatronParallelConfig(tensor_model_parallel_size=3).validate(3, config)
    MegatronParallelConfig(pipeline_model_parallel_size=2).validate(2, config)
    with pytest.raises(ValueError, match="heads 9 / key-value heads 3 are not both divisible"):
        MegatronParallelConfig(tensor_model_parallel_size=2).validate(2, config)


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rope_settings_match_hf(rope):
    """Megatron's rotary angles from ``rope_settings`` equal HF's (theta 1e5, no / linear / llama3 scaling)."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from backends.megatron.hf_mapping import rope_settings

    extra = {} if rope is None else {"rope_parameters": {**rope, "rope_theta": 100000.0}}
    config = smollm2_shaped_llama(hidden_size=576, max_position_embeddings=16384, **extra)  # SmolLM2's head_dim 64
    settings = rope_settings(config)
    T, head_dim = 2048, config.head_dim
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, T, head_dim), torch.arange(T)[None])
    megatron = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, use_cpu_initialization=True, **settings)
    freqs = megatron.get_freqs_non_repeated(T)
    angles = torch.cat([freqs, freqs], -1)  # megatron's non-interleaved layout, as HF's rotate_half
    assert_close(angles.cos(), cos[0], "cos", tol=1e-6)
    assert_close(angles.sin(), sin[0], "sin", tol=1e-6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(mlp_bias=True), "mlp_bias=True"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "rope_type 'dynamic'"),
        (
            dict(
                rope_parameters={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 4096,
                    "rope_theta": 1e4,
                }
            ),
            "llama3 rope scaling",
        ),
    ],
)
def test_unmappable_llama_raises(overrides, message):
    from backends.megatron.hf_mapping import layout_from_hf

    with pytest.raises(ValueError, match=message):
        layout_from_hf(smollm2_shaped_llama(**overrides))


def test_unmappable_model_type_raises():
    from transformers import GPT2Config, Qwen2Config

    from backends.megatron.hf_mapping import layout_from_hf

    with pytest.raises(ValueError, match=r"model types \['qwen2', 'qwen3', 'llama', 'qwen3_moe', 'mixtral'\].*'gpt2'"):
        layout_from_hf(GPT2Config())
    with pytest.raises(ValueError, match="sliding-window attention"):
        layout_from_hf(Qwen2Config(use_sliding_window=True))
