"""HF rollout engine: output layout, EOS handling, n and seeding, log-probs vs a forward pass, weight updates."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from backends.rollout.base import SamplingConfig, get_rollout
from tests.backends.conftest import check_layout, recompute_log_probs


def test_registry_and_lazy_imports():
    import backends.rollout  # noqa: F401

    assert get_rollout("hf").__name__ == "HFRolloutEngine"
    assert get_rollout("vllm").__name__ == "VLLMRolloutEngine"
    code = (
        "import sys; from backends.rollout import get_rollout; get_rollout('vllm'); get_rollout('hf'); "
        "bad = [m for m in ('vllm', 'ray', 'transformers', 'scaletrain.controller', 'scaletrain.trainer', "
        "'scaletrain.workers') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_layout_sampled(hf_engine, prompts):
    out = hf_engine.generate(prompts, SamplingConfig(n=3, temperature=1.0, max_new_tokens=16, seed=0))
    check_layout(out, prompts, n=3, max_new=16)
    lengths = out.batch["response_mask"].sum(1)
    assert (lengths < 16).any() and (lengths == 16).any(), "the tiny model should stop early on some rows only"
    assert out.meta_info["rollout_engine"] == "hf"


def test_layout_greedy_n(hf_engine, prompts):
    out = hf_engine.generate(prompts, SamplingConfig(n=2, temperature=0.0, max_new_tokens=12))
    check_layout(out, prompts, n=2, max_new=12)
    assert torch.equal(out.batch["responses"][0::2], out.batch["responses"][1::2])


def test_seeding(hf_engine, prompts):
    def run(seed):
        return hf_engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, max_new_tokens=10, seed=seed))

    state = torch.get_rng_state()
    a, b, c = run(1), run(1), run(2)
    assert torch.equal(torch.get_rng_state(), state), "a seeded call must not move the global RNG"
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    assert torch.equal(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"])
    assert not torch.equal(a.batch["responses"], c.batch["responses"])
    assert not torch.equal(a.batch["responses"][0::2], a.batch["responses"][1::2]), "n samples must differ"


@pytest.mark.parametrize("temperature,top_k", [(0.7, -1), (0.0, -1), (1.0, 5)])
def test_log_probs_match_forward(hf_engine, prompts, temperature, top_k):
    sampling = SamplingConfig(n=2, temperature=temperature, top_k=top_k, max_new_tokens=12, seed=3)
    out = hf_engine.generate(prompts, sampling)
    mask = out.batch["response_mask"].bool()
    expected = recompute_log_probs(hf_engine.model, out, temperature, top_k)
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask], expected[mask], atol=1e-4, rtol=1e-4)


def test_top_k_one_is_greedy(hf_engine, prompts):
    greedy = hf_engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=10))
    top1 = hf_engine.generate(prompts, SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=10, seed=0))
    assert torch.equal(greedy.batch["responses"], top1.batch["responses"])
    # log-probs are those of the truncated distribution the token was drawn from: one token, probability 1
    assert top1.batch["rollout_log_probs"].abs().max() < 1e-6


def test_update_weights(rollout_config, rollout_tokenizer, prompts):
    engine = get_rollout("hf")(rollout_config, rollout_tokenizer)
    trainer = get_rollout("hf")(rollout_config, rollout_tokenizer)  # its model plays the trained policy
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.model.parameters():  # tied embeddings stay tied
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=12)
    before = engine.generate(prompts, greedy)
    items = list(trainer.model.state_dict().items())
    engine.update_weights([items[i : i + 4] for i in range(0, len(items), 4)])
    for (name, value), (_, expected) in zip(engine.model.state_dict().items(), items):
        assert torch.equal(value, expected), name
    after, wanted = engine.generate(prompts, greedy), trainer.generate(prompts, greedy)
    assert torch.equal(after.batch["responses"], wanted.batch["responses"])
    assert not torch.allclose(after.batch["rollout_log_probs"], before.batch["rollout_log_probs"])
    with pytest.raises(KeyError, match="model.nope.weight"):
        engine.update_weights([[("model.nope.weight", torch.zeros(1))]])
