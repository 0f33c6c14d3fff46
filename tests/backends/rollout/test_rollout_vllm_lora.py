"""The vLLM engine serving a LoRA adapter (backends/rollout/vllm_lora.py): the adapter-only weight sync.

An adapter (PEFT, random B so it matters) goes in through ``update_adapter``; the engine's sampled log-probs are then
those of the same adapter merged into the HF model, and its greedy tokens those of the merged model, while its base
weights stay as loaded; a second update replaces the first (an adapter with B = 0 gives the base model's outputs
back).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from backends.rollout.base import SamplingConfig
from tests.backends.conftest import recompute_log_probs

pytest.importorskip("vllm")

RANK = 4
GREEDY = SamplingConfig(n=1, temperature=0.0, max_new_tokens=12)


def peft_adapter(model_dir: str, seed: int = 0):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    return model


def adapter_buckets(model, scale: float = 1.0):
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    return [[(k, v * scale if ".lora_B." in k else v) for k, v in state.items()]]


def test_lora_arguments():
    from backends.rollout.vllm_lora import lora_arguments

    assert lora_arguments(0) == {}
    assert lora_arguments(RANK) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    assert lora_arguments(64)["max_lora_rank"] == 64
    with pytest.raises(ValueError, match="rank <= 512"):
        lora_arguments(1024)


def test_orphaned_adapter_directories_are_removed(tmp_path):
    """A killed worker leaves its adapter directory behind; the next slot removes it (not a live process's)."""
    import subprocess
    import sys

    from backends.rollout.vllm_lora import PREFIX, _remove_orphans

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan, live = tmp_path / f"{PREFIX}{dead.stdout.strip()}-x", tmp_path / f"{PREFIX}{os.getpid()}-y"
    for folder in (orphan, live, tmp_path / "other"):
        folder.mkdir()
    _remove_orphans(str(tmp_path))
    assert not orphan.exists() and live.exists() and (tmp_path / "other").exists()


def test_hf_engine_refuses_an_adapter(hf_engine):
    with pytest.raises(NotImplementedError, match="sync merged weights instead"):
        hf_engine.update_adapter([], {})


@pytest.fixture(scope="module")
def lora_engine(rollout_config, rollout_tokenizer):
    from backends.rollout.vllm_engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(replace(rollout_config, lora_rank=RANK), rollout_tokenizer)
    yield engine
    root = engine.adapter.root
    engine.adapter.close()
    del engine.llm
    assert not os.path.exists(root)


def test_served_adapter_equals_merged_weights(lora_engine, rollout_config, rollout_tokenizer, prompts, tmp_path):
    from backends.lora_weights import adapter_config_dict
    from backends.rollout.hf import HFRolloutEngine

    engine = lora_engine
    base_out = engine.generate(prompts, GREEDY)  # no adapter synced yet: the base model
    model = peft_adapter(rollout_config.model_path)
    config = adapter_config_dict(model.peft_config["default"])
    nbytes = engine.update_adapter(adapter_buckets(model), config)
    assert nbytes == sum(t.numel() * t.element_size() for _, t in adapter_buckets(model)[0])
    first_dir = engine.adapter.request.lora_path

    sampled = engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, max_new_tokens=12, seed=1))
    merged = model.merge_and_unload().eval()
    expected = recompute_log_probs(merged, sampled, temperature=1.0)
    mask = sampled.batch["response_mask"].bool()
    torch.testing.assert_close(sampled.batch["rollout_log_probs"][mask], expected[mask], atol=2e-4, rtol=0)
    served = engine.generate(prompts, GREEDY).batch["responses"]
    assert not torch.equal(served, base_out.batch["responses"])
    # the merged model, saved as a plain HF checkpoint, generates the same greedy tokens (the hf engine: a second
    # vLLM engine in this process would tear down the first one's parallel state when it goes)
    merged.save_pretrained(str(tmp_path / "merged"))
    merged_engine = HFRolloutEngine(replace(rollout_config, model_path=str(tmp_path / "merged")), rollout_tokenizer)
    assert torch.equal(merged_engine.generate(prompts, GREEDY).batch["responses"], served)

    # a new adapter replaces the old one (a new id and directory; the old one removed): B = 0 is the base
    engine.update_adapter(adapter_buckets(peft_adapter(rollout_config.model_path), scale=0.0), config)
    assert engine.adapter.request.lora_int_id == 2 and not os.path.exists(first_dir)
    back = engine.generate(prompts, GREEDY)
    assert torch.equal(back.batch["responses"], base_out.batch["responses"])
    torch.testing.assert_close(back.batch["rollout_log_probs"], base_out.batch["rollout_log_probs"], atol=1e-5, rtol=0)


@pytest.mark.slow  # AsyncLLM's engine core runs in a process of its own
def test_async_engine_serves_the_adapter(lora_engine, rollout_config, rollout_tokenizer, rollout_model_dir):
    """The agent loops' engine (its engine core in another process reads the adapter directory) samples what the
    synchronous engine samples with the same adapter."""
    from backends.lora_weights import adapter_config_dict
    from backends.rollout.vllm_async import VLLMAsyncRolloutEngine
    from tests.backends.rollout.test_rollout_vllm_async import token_requests

    model = peft_adapter(rollout_model_dir, seed=1)
    config = adapter_config_dict(model.peft_config["default"])
    engine = VLLMAsyncRolloutEngine(replace(rollout_config, lora_rank=RANK), rollout_tokenizer)
    try:
        for target in (engine, lora_engine):
            target.update_adapter(adapter_buckets(model), config)
        requests = token_requests(rollout_tokenizer, seed=None)
        got, want = engine.generate_tokens(requests), lora_engine.generate_tokens(requests)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-4, rtol=1e-4)
    finally:
        engine.adapter.close()
        engine.close()
