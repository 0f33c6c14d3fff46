"""Shared fixtures of the rollout-engine tests: one tiny model on disk, one vLLM engine per session.

The model is the tiny Qwen2 of tests/backends/tiny.py widened to head_dim 32 (vLLM's CPU attention needs it),
initialised with a larger std (0.2) so greedy logits have clear gaps (no near-ties between HF and vLLM), and with
the (tied) EOS embedding row scaled up so that some samples stop early and others run to max_new_tokens.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.backends.tiny import EOS_ID, PAD_ID, make_tokenizer, tiny_qwen2_config

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ROLLOUT_MODEL = dict(
    hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2
)
EOS_SCALE = 1.5
PROMPTS = ["hello", "ab", "a longer prompt", "x", "What is 2+3?", "zzz", "The quick brown fox", "42"]


def _save_rollout_model(path: str, seed: int = 0) -> str:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(**ROLLOUT_MODEL))
    with torch.no_grad():
        model.model.embed_tokens.weight[EOS_ID] *= EOS_SCALE
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def rollout_model_dir(tmp_path_factory) -> str:
    return _save_rollout_model(str(tmp_path_factory.mktemp("rollout_model")))


@pytest.fixture(scope="session")
def rollout_tokenizer():
    tok = make_tokenizer()
    tok.padding_side = "left"
    return tok


def make_prompts(tokenizer, texts=PROMPTS):
    """Left-padded prompts with positions, an extra tensor field, a non-tensor field and meta_info."""
    from scaletrain.protocol import DataProto

    enc = tokenizer(list(texts), return_tensors="pt", padding=True)
    mask = enc["attention_mask"]
    return DataProto.from_dict(
        {
            "input_ids": enc["input_ids"],
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "index": torch.arange(len(texts)),
        },
        {"uid": np.array([f"u{i}" for i in range(len(texts))], dtype=object)},
        {"global_step": 3},
    )


@pytest.fixture
def prompts(rollout_tokenizer):
    return make_prompts(rollout_tokenizer)


@pytest.fixture(scope="session")
def rollout_config(rollout_model_dir):
    from backends.rollout.base import RolloutConfig

    return RolloutConfig(model_path=rollout_model_dir, dtype="float32", max_model_len=256, kv_cache_bytes=32 << 20)


@pytest.fixture(scope="session")
def hf_engine(rollout_config, rollout_tokenizer):
    """Read-only HF engine on the original weights (tests that change weights build their own)."""
    from backends.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(rollout_config, rollout_tokenizer)


@pytest.fixture(scope="session")
def _vllm_engine_holder():
    holder: dict = {}
    yield holder
    if "engine" in holder:
        del holder.pop("engine").llm


@pytest.fixture
def vllm_engine(_vllm_engine_holder, rollout_config, rollout_tokenizer):
    """The session's one in-process vLLM engine. Tests that push weights restore the originals afterwards.

    vLLM keeps its parallel groups process-wide, and shutting down any in-process engine destroys them
    (``EngineCore.shutdown``): after another test's or module's engine was shut down in this process, this one
    could no longer run ("pipeline model parallel group is not initialized"; seen when tests/agent's vLLM test
    ran between two users of this engine). It is rebuilt then."""
    pytest.importorskip("vllm")
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    from backends.rollout.vllm_engine import VLLMRolloutEngine

    engine = _vllm_engine_holder.get("engine")
    if engine is not None and not model_parallel_is_initialized():
        # shut down now, once (vLLM's own guard): a later garbage collection must not tear down the new engine's groups
        _vllm_engine_holder.pop("engine").llm.llm_engine.engine_core.shutdown()
        engine = None
    if engine is None:
        engine = _vllm_engine_holder["engine"] = VLLMRolloutEngine(rollout_config, rollout_tokenizer)
    return engine


def recompute_log_probs(model, out, temperature: float, top_k: int = -1) -> torch.Tensor:
    """log_softmax(logits / T) at each response token, from one forward pass over the rollout's sequences
    (with top_k > 0: over the k largest logits only, the truncated distribution the token was drawn from)."""
    responses = out.batch["responses"]
    R = responses.shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=out.batch["input_ids"],
            attention_mask=out.batch["attention_mask"],
            position_ids=out.batch["position_ids"],
        ).logits.float()
    logits = logits[:, -R - 1 : -1] / (temperature if temperature > 0 else 1.0)
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def check_layout(out, prompts, n: int, max_new: int, eos_id: int = EOS_ID, pad_id: int = PAD_ID) -> None:
    """Assert the base.py layout: shapes, dtypes, repeated prompt rows, masks up to EOS, padding, positions."""
    B, P = prompts.batch["input_ids"].shape
    rows, R = B * n, max_new
    b = out.batch
    assert len(out) == rows
    for key, width in [
        ("prompts", P),
        ("responses", R),
        ("response_mask", R),
        ("rollout_log_probs", R),
        ("input_ids", P + R),
        ("attention_mask", P + R),
        ("position_ids", P + R),
    ]:
        assert tuple(b[key].shape) == (rows, width), key
    assert b["rollout_log_probs"].dtype == torch.float32
    rep = torch.arange(B).repeat_interleave(n)
    assert torch.equal(b["prompts"], prompts.batch["input_ids"][rep])
    assert torch.equal(b["index"], prompts.batch["index"][rep])
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in rep.tolist()]
    assert out.meta_info["global_step"] == 3
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    mask = b["response_mask"]
    assert torch.equal(b["attention_mask"], torch.cat([prompts.batch["attention_mask"][rep], mask], dim=1))
    last = prompts.batch["position_ids"][rep][:, -1:]
    assert torch.equal(b["position_ids"][:, :P], prompts.batch["position_ids"][rep])
    assert torch.equal(b["position_ids"][:, P:], last + torch.arange(1, R + 1))
    for row in range(rows):
        resp, m = b["responses"][row], mask[row]
        length = int(m.sum())
        assert torch.equal(m[:length], torch.ones(length, dtype=m.dtype)) and not m[length:].any()
        eos = (resp[:length] == eos_id).nonzero().flatten().tolist()
        assert eos in ([], [length - 1]), f"row {row}: EOS must end the masked part only"
        if length < R:
            assert eos == [length - 1], f"row {row}: stopped early without EOS"
            assert (resp[length:] == pad_id).all()
        assert (b["rollout_log_probs"][row, length:] == 0).all()
        assert (b["rollout_log_probs"][row, :length] <= 0).all()
        assert torch.isfinite(b["rollout_log_probs"][row]).all()
