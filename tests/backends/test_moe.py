"""backends/moe.py and backends/checkpoint/hf_names.py in one process, on tiny random Qwen3-MoE and Mixtral models:

- the router terms the engines add equal transformers' own: the load-balancing loss HF's ``output_router_logits``
  returns (pads excluded through the attention mask), the z-loss from HF's router logits; the padded and the packed
  (remove-padding) forward give the same terms; recomputed layers (gradient checkpointing) are not counted twice;
- the coefficients' checks: negative values, and a non-zero one on a dense model, are refused naming the key;
- the exported checkpoint layout is what ``save_pretrained`` writes, tensor for tensor (per-expert names for the
  fused experts), and a dense or a vision-language model's names pass through unchanged.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.tiny import EOS_ID, PAD_ID, make_batch, vocab

ARCHITECTURES = ("qwen3_moe", "mixtral")


def tiny_model(architecture: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    from scaletrain.models.tiny import tiny_config

    config = tiny_config(architecture, len(vocab()), PAD_ID, 1, EOS_ID, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # norms start at 1: random ones, so that a norm mapped from the wrong place shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def routed_forward(model, batch):
    """transformers' forward of the padded batch with every MoE layer's router logits (``out.router_logits``, one
    (tokens, experts) tensor per layer, tokens in the batch's row-major order) and its load-balancing loss."""
    b = batch.batch
    return model(
        input_ids=b["input_ids"],
        attention_mask=b["attention_mask"],
        position_ids=b["position_ids"],
        output_router_logits=True,
    )


def hf_router_terms(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' load-balancing loss of the padded batch and the z-loss of its router logits at real tokens."""
    out = routed_forward(model, batch)
    mask = batch.batch["attention_mask"].reshape(-1).bool()
    z = torch.stack([torch.logsumexp(lg[mask].float(), -1).square().mean() for lg in out.router_logits]).mean()
    return out.aux_loss, z


def engine_terms(model, batch, remove_padding: bool) -> dict[str, torch.Tensor]:
    from backends.hf_model import forward_micro_batch
    from backends.moe import RouterRecorder

    recorder = RouterRecorder(model)
    valid = None if remove_padding else batch.batch["attention_mask"]
    with recorder.recording(valid):
        forward_micro_batch(model, dict(batch.batch.items()), ("log_probs",), remove_padding=remove_padding)
    return recorder.terms()


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_router_terms_equal_transformers_on_both_paths(architecture):
    model = tiny_model(architecture)
    batch = make_batch(batch_size=6, prompt_len=10, response_len=8)
    with torch.no_grad():
        aux, z = hf_router_terms(model, batch)
        padded, packed = engine_terms(model, batch, False), engine_terms(model, batch, True)
    for terms in (padded, packed):
        assert torch.allclose(terms["router_aux_loss"], aux, atol=1e-6), (terms["router_aux_loss"], aux)
        assert torch.allclose(terms["router_z_loss"], z, atol=1e-5), (terms["router_z_loss"], z)
    # 4 experts, top-2: balanced routing gives 1.0, everything on two experts 2.0
    assert 1.0 <= float(padded["router_load_imbalance"]) <= 2.0
    assert torch.allclose(padded["router_load_imbalance"], packed["router_load_imbalance"])
    # the pads are really excluded: counting them changes the loss
    pads = (batch.batch["attention_mask"] == 0).sum()
    assert pads > 0
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    out = model(input_ids=batch.batch["input_ids"], output_router_logits=True)
    assert not torch.allclose(load_balancing_loss_func(out.router_logits, 4, 2), aux, atol=1e-4)


def test_router_losses_backpropagate_once_per_layer_under_recompute():
    from backends.hf_model import forward_micro_batch
    from backends.moe import RouterRecorder, add_router_terms

    model = tiny_model("qwen3_moe").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    recorder = RouterRecorder(model)
    batch = make_batch(batch_size=4)
    with recorder.recording(None):
        out = forward_micro_batch(model, dict(batch.batch.items()), ("log_probs",), remove_padding=True)
    loss, metrics = add_router_terms(out["log_probs"].sum() * 0, {}, recorder.terms(), aux_coef=1.0, z_coef=0.0)
    loss.backward()
    assert len(recorder.logits) == model.config.num_hidden_layers  # the backward's recomputation adds none
    router = model.model.layers[0].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0  # the aux loss alone trains the router
    assert set(metrics) == {"router_aux_loss", "router_z_loss", "router_load_imbalance"}


def test_dense_models_record_nothing_and_refuse_router_coefficients():
    from backends.moe import RouterRecorder, add_router_terms, check_router_settings

    dense = tiny_model("qwen3")
    recorder = RouterRecorder(dense)
    assert not recorder.active
    with recorder.recording(None):
        dense(input_ids=torch.tensor([[5, 6, 7]]))
    assert recorder.terms() == {}
    loss = torch.tensor(1.0)
    assert add_router_terms(loss, {"a": 1.0}, {}, 0.5, 0.5) == (loss, {"a": 1.0})
    check_router_settings(dense, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"model.router_aux_loss_coef=0.01 but Qwen3ForCausalLM has no mixture"):
        check_router_settings(dense, 0.01, 0.0)
    with pytest.raises(ValueError, match=r"critic.model.router_z_loss_coef must be a number >= 0, got -1"):
        check_router_settings(tiny_model("qwen3_moe"), 0.0, -1, key="critic.model")


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_export_layout_is_save_pretrained_s(architecture, tmp_path):
    from safetensors.torch import load_file

    from backends.base import bucketed
    from backends.checkpoint.hf_names import checkpoint_layout

    model = tiny_model(architecture)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    items = [(n, t.numel() * t.element_size(), lambda t=t: t) for n, t in model.state_dict().items()]
    exported = dict(p for bucket in checkpoint_layout(bucketed(items, 4096), model) for p in bucket)
    head = exported.pop("lm_head.weight")
    assert model.config.tie_word_embeddings and head.data_ptr() == exported["model.embed_tokens.weight"].data_ptr()
    assert sorted(exported) == sorted(saved)  # save_pretrained leaves the tied head out
    assert all(torch.equal(exported[k], v) for k, v in saved.items())
    per_expert = "mlp.experts.3.down_proj.weight" if architecture == "qwen3_moe" else "block_sparse_moe.experts.3.w2"
    assert any(per_expert in k for k in exported)
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in exported)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_hf_rollout_loads_synced_experts_in_the_checkpoint_layout(tmp_path, architecture):
    """The HF rollout holds transformers' fused experts and receives the sync's per-expert tensors (the checkpoint
    layout): every tensor lands where it belongs, with a fused tensor's pieces split over buckets; a wrong shape and
    an unknown name are refused naming the tensor."""
    from backends.base import bucketed
    from backends.checkpoint.hf_names import checkpoint_layout
    from backends.rollout.base import RolloutConfig, get_rollout
    from tests.backends.tiny import make_tokenizer

    tiny_model(architecture, seed=0).save_pretrained(tmp_path)
    engine = get_rollout("hf")(RolloutConfig(model_path=str(tmp_path), dtype="float32"), make_tokenizer())
    trained = tiny_model(architecture, seed=1)
    items = [(n, t.numel() * t.element_size(), lambda t=t: t) for n, t in trained.state_dict().items()]
    buckets = [list(b) for b in checkpoint_layout(bucketed(items, 2048), trained)]
    engine.update_weights(buckets)
    mine, wanted = engine.model.state_dict(), trained.state_dict()
    assert sorted(mine) == sorted(wanted) and any(k.endswith("experts.gate_up_proj") for k in mine)
    assert all(torch.equal(mine[k], v) for k, v in wanted.items()), [
        k for k, v in wanted.items() if not torch.equal(mine[k], v)
    ]
    expert = next(n for b in buckets for n, _ in b if n.endswith(("experts.2.down_proj.weight", "experts.2.w2.weight")))
    with pytest.raises(ValueError, match=expert.replace(".", "\\.")):
        engine.update_weights([[(expert, torch.zeros(3, 3))]])
    with pytest.raises(KeyError, match="experts.9"):
        engine.update_weights([[(expert.replace("experts.2", "experts.9"), torch.zeros(3, 3))]])


def test_models_that_only_rename_keep_their_names():
    from transformers import Qwen2_5_VLForConditionalGeneration

    from backends.checkpoint.hf_names import checkpoint_layout, converts_layout
    from scaletrain.models.tiny_vlm import build_vlm_tokenizer, tiny_qwen2_5_vl_config

    dense, vlm = (
        tiny_model("qwen3"),
        Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config(build_vlm_tokenizer(), shape="embedded")),
    )
    for model in (dense, vlm):
        assert not converts_layout(model)
        bucket = list(model.state_dict().items())
        assert next(iter(checkpoint_layout([bucket], model))) is bucket


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_megatron_mapping_round_trip_over_expert_layouts(architecture):
    """backends/megatron/moe_mapping.py through hf_mapping: every (TP, PP, EP, ETP) split of the model's tensors
    (fused experts) maps back to them exactly; EP rank e holds experts e*E/EP.. of each layer, an ETP shard the rows
    of the gate and of the up projection ([gate_t; up_t]) as the checkpoint files name them, the router whole."""
    from backends.checkpoint.hf_names import checkpoint_layout
    from backends.megatron.export import export_groups
    from backends.megatron.hf_mapping import hf_to_rank, layout_from_hf, ranks_to_hf

    model = tiny_model(architecture)
    hf = dict(model.state_dict())  # in memory: the experts fused
    files = {k: v for b in checkpoint_layout([list(hf.items())], model) for k, v in b}  # per expert
    experts = "mlp.experts" if architecture == "qwen3_moe" else "block_sparse_moe.experts"
    gate = ("gate_proj", "up_proj") if architecture == "qwen3_moe" else ("w1", "w3")
    for tp, pp, ep in [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 2, 2), (1, 1, 4)]:
        for etp in sorted({1, tp}):
            lo = layout_from_hf(model.config, tp, pp, "causal_lm", ep, etp)
            ranks = [(t, s, e) for t in range(tp) for s in range(pp) for e in range(ep)]
            shards = {r: hf_to_rank(hf, lo, *r) for r in ranks}
            back = ranks_to_hf(shards, lo)
            assert sorted(back) == sorted(hf), (tp, pp, ep, etp, sorted(set(hf) ^ set(back)))
            assert all(torch.equal(back[k], v) for k, v in hf.items()), (tp, pp, ep, etp)
            assert sorted(n for g in export_groups(lo, list(hf)) for n in g.hf) == sorted(hf)
            t, e = tp - 1, ep - 1
            fc1 = shards[(t, 0, e)]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
            first = e * 4 // ep  # the 4 experts' first on the last EP rank
            want = [files[f"model.layers.0.{experts}.{first}.{p}.weight"].chunk(etp)[t if etp > 1 else 0] for p in gate]
            assert torch.equal(fc1, torch.cat(want)), (tp, pp, ep, etp)
            assert len([n for n in shards[(0, 0, 0)] if ".local_experts." in n]) == 2 * 4 // ep * (2 // pp)


@pytest.mark.parametrize(
    "architecture, overrides, message",
    [
        ("qwen3_moe", {"mlp_only_layers": [1]}, "dense layers among the MoE ones"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "dense layers among the MoE ones"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise 0.1"),
        ("mixtral", {"sliding_window": 16}, "sliding-window attention"),
    ],
)
def test_megatron_refuses_what_its_moe_mapping_does_not_carry(architecture, overrides, message):
    from backends.megatron.hf_mapping import layout_from_hf
    from scaletrain.models.tiny import tiny_config

    with pytest.raises(ValueError, match=message):
        layout_from_hf(tiny_config(architecture, len(vocab()), PAD_ID, 1, EOS_ID, **overrides))
