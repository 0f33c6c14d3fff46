"""LoRA adapter training on the FSDP2 and DeepSpeed ZeRO-3 engines (backends/lora.py, backends/lora_weights.py).

Fast checks: the ModelConfig keys are validated, the Megatron backend refuses LoRA on a value model (its LoRA on a
causal LM: tests/backends/test_megatron_engine.py), and the merged / adapter exports of a single-process PEFT model
equal PEFT's own ``merge_and_unload`` / adapter state dict.

Slow checks: one 2-rank gloo launch per backend (tests/backends/multirank.py) runs every check of
tests/backends/lora_checks.py against a single-process PEFT reference (same LoraConfig, same seed so the adapter
init matches, torch AdamW on the adapter parameters only): the LoRA step equals it, only the adapters change, the
merged export equals ``merge_and_unload``, the adapter-disabled forward is the base model's, the adapter directory
of ``save_hf`` loads in PEFT (and starts a forward-only remove-padding engine), a value model trains its head, and
a checkpoint resumes exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")  # setup.py's "models" extra

from tests.backends.lora_checks import CHECKS, SEED, WORLD, lora_model_config, peft_reference
from tests.backends.multirank import assert_close, assert_ranks_passed, launch


# ------------------------------------------------------------------------------------------------ fast checks
@pytest.mark.parametrize(
    "keys, match",
    [
        ({"lora_rank": -1}, "model.lora_rank"),
        ({"lora_rank": 4, "lora_alpha": 0}, "model.lora_alpha"),
        ({"lora_rank": 4, "target_modules": []}, "model.target_modules"),
        ({"lora_rank": 4, "exclude_modules": [""]}, "model.exclude_modules"),
        ({"lora_adapter_path": "/some/adapter"}, "model.lora_adapter_path needs model.lora_rank"),
    ],
)
def test_lora_keys_validated(keys, match):
    from backends.config import ModelConfig

    with pytest.raises(ValueError, match=match):
        ModelConfig(path="/m", **keys)


def test_adapter_path_checked(tmp_path):
    from backends.hf_model import build_model
    from tests.backends.tiny import save_tiny_qwen2

    model_dir = save_tiny_qwen2(str(tmp_path / "model"), with_tokenizer=False)
    with pytest.raises(ValueError, match="model.lora_adapter_path: .* not a PEFT adapter directory"):
        build_model(lora_model_config(model_dir, dtype="float32", lora_adapter_path=str(tmp_path / "missing")))
    peft_reference(model_dir).save_pretrained(str(tmp_path / "adapter"))
    with pytest.raises(ValueError, match="has rank 4, model.lora_rank is 8"):
        build_model(
            lora_model_config(model_dir, dtype="float32", lora_rank=8, lora_adapter_path=str(tmp_path / "adapter"))
        )
    with pytest.raises(ValueError, match="model.target_modules.*no_such_layer.* not found"):
        build_model(lora_model_config(model_dir, dtype="float32", target_modules=["no_such_layer"]))


def test_base_model_refused_without_adapters():
    from backends.base import base_model_only
    from backends.config import ForwardOptions

    assert base_model_only(ForwardOptions(base_model=True), has_adapter=True)
    assert not base_model_only(ForwardOptions(), has_adapter=False)
    with pytest.raises(ValueError, match="no adapters"):
        base_model_only(ForwardOptions(base_model=True), has_adapter=False)


def test_megatron_refuses_lora_on_a_value_model():
    """Megatron's LoRA adapts a causal LM (backends/megatron/lora.py; its checks: tests/backends/test_megatron_engine.py
    ``lora``); a value model's fails naming the backends that train it."""
    from backends.base import get_backend
    from backends.config import EngineConfig

    with pytest.raises(ValueError, match="megatron backend trains LoRA adapters on a causal LM .*backend=fsdp"):
        get_backend("megatron")(lora_model_config("/m", kind="value"), None, EngineConfig())


@pytest.mark.parametrize("kind", ["causal_lm", "value"])
def test_exports_match_peft(tmp_path, kind):
    """The merged items of a PEFT model with non-zero adapters equal ``merge_and_unload``; the adapter items equal
    PEFT's adapter state dict (names and tensors)."""
    from peft.utils import get_peft_model_state_dict

    from backends.hf_model import build_model
    from backends.lora_weights import LoraLayout
    from tests.backends.tiny import save_tiny_qwen2

    model_dir = save_tiny_qwen2(str(tmp_path / "model"), with_tokenizer=False)
    torch.manual_seed(SEED)
    model = build_model(lora_model_config(model_dir, dtype="float32", kind=kind))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n in model.state_dict() if ".lora_" in n or ".modules_to_save." in n
    }
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)  # lora_B starts at zero: make every adapter count
    items = [(n, v.numel() * v.element_size(), lambda v=v: v.detach().clone()) for n, v in model.state_dict().items()]
    layout = LoraLayout.of(model)
    adapter = {n: get() for n, _, get in layout.adapter_items(items)}
    expected = get_peft_model_state_dict(model)
    assert list(adapter) == list(expected)
    for k, v in expected.items():
        assert torch.equal(adapter[k], v), k
    merged = {n: get() for n, _, get in layout.merged_items(items)}
    unloaded = copy.deepcopy(model).merge_and_unload().state_dict()
    assert list(merged) == list(unloaded)
    for k, v in unloaded.items():
        assert_close(merged[k], v, f"merged {k}", tol=1e-6)
    base_q = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert (merged["model.layers.0.self_attn.q_proj.weight"] - base_q).abs().max() > 0.01


# ------------------------------------------------------------------------------------------------ 2-rank launches
@pytest.fixture(scope="module", params=["fsdp", "deepspeed"])
def results(request, tmp_path_factory):
    if request.param == "deepspeed":
        pytest.importorskip("deepspeed")
    from tests.backends.tiny import save_tiny_qwen2

    work = tmp_path_factory.mktemp(f"lora_{request.param}_2rank")
    save_tiny_qwen2(str(work / "model"), seed=0, initializer_range=0.1)
    (work / "backend").write_text(request.param)
    return launch("tests.backends.lora_checks", work, WORLD, timeout_s=300)


@pytest.mark.slow  # a multi-process launch (setup.cfg: `pytest -m "not slow"` skips it)
@pytest.mark.parametrize("check", CHECKS)
def test_two_rank(results, check):
    assert_ranks_passed(results, check)
