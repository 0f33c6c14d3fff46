"""The memory plan's arithmetic (backends/memory.py): its states by backend and layout, the shape it reads from a
checkpoint, and its step peak against a real fsdp engine's, measured with torch's allocator."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends import memory as mem
from backends.config import ModelConfig
from tests.backends.memory_probe import engine_step_peak
from tests.backends.tiny import make_batch, save_tiny_qwen2

SHAPE = mem.ModelShape(params=1000, trainable=1000, hidden=64, layers=2, intermediate=256, vocab=128, kv_dim=64)


def test_states_follow_each_backends_sharding_and_offload():
    fsdp, _ = mem.state_bytes(SHAPE, mem.TrainLayout(backend="fsdp", world=2))
    assert fsdp == {"parameters": 2000, "optimizer": 4000}  # float32 halves, two Adam moments; grads freed
    assert mem.freed_gradients(SHAPE, mem.TrainLayout(backend="fsdp", world=2)) == 2000
    ds, _ = mem.state_bytes(SHAPE, mem.TrainLayout(backend="deepspeed", world=2, reduce_bucket=10))
    assert ds == {"parameters": 2000, "optimizer": 6000, "gradients": 2000 + 40}  # master copy; bucket whole
    meg, _ = mem.state_bytes(SHAPE, mem.TrainLayout(backend="megatron", world=4, tp=2))
    assert meg == {"parameters": 2000, "optimizer": 4000, "gradients": 2000}  # TP splits; DP=2 does not
    dist_opt, _ = mem.state_bytes(SHAPE, mem.TrainLayout(backend="megatron", world=4, tp=2, distributed_optimizer=True))
    assert dist_opt["optimizer"] == 2000
    device, host = mem.state_bytes(SHAPE, mem.TrainLayout(backend="fsdp", world=1, optimizer_offload=True))
    assert device == {"parameters": 4000} and host == {"optimizer": 8000}
    frozen, _ = mem.state_bytes(SHAPE, mem.TrainLayout(backend="fsdp", world=1, trains=False, weight_bytes=2))
    assert frozen == {"parameters": 2000}


def test_megatron_splits_a_mixture_of_experts_experts_over_expert_parallelism():
    """600 of the 1000 parameters are experts: TP=2 halves the dense 400; EP=2 x ETP=2 quarters the experts; the
    distributed optimizer splits the dense moments over DP=2, the experts' over expert DP (4 / (2 x 2) = 1)."""
    moe = dataclasses.replace(SHAPE, expert_params=600)
    ep, _ = mem.state_bytes(moe, mem.TrainLayout(backend="megatron", world=4, tp=2, ep=2))
    assert ep == {"parameters": (200 + 150) * 4, "optimizer": 350 * 8, "gradients": 350 * 4}
    etp1, _ = mem.state_bytes(moe, mem.TrainLayout(backend="megatron", world=4, tp=2, ep=2, etp=1))
    assert etp1["parameters"] == (200 + 300) * 4  # each expert whole on its EP rank
    dist_opt, _ = mem.state_bytes(moe, mem.TrainLayout("megatron", 4, tp=2, ep=2, distributed_optimizer=True))
    assert dist_opt["optimizer"] == 200 * 8 // 2 + 150 * 8
    dense, _ = mem.state_bytes(moe, mem.TrainLayout(backend="megatron", world=4, tp=2))
    assert dense["parameters"] == (200 + 300) * 4  # EP=1: the experts split as the dense layers


def test_a_mixture_of_experts_counts_its_experts():
    from backends.config import ModelConfig
    from tests.backends.test_moe import tiny_model

    for architecture in ("qwen3_moe", "mixtral"):
        model = tiny_model(architecture)
        shape = mem.model_shape(ModelConfig(path="unused"), model.config)
        experts = sum(p.numel() for layer in model.model.layers for p in layer.mlp.experts.parameters())
        assert shape.expert_params == experts > 0 and shape.params > experts, (architecture, shape)


def test_recompute_and_sequence_parallel_shrink_activations():
    deep = dataclasses.replace(SHAPE, layers=8)
    layout = mem.TrainLayout(backend="fsdp", world=2)
    micro = mem.MicroBatchShape(tokens=4096, head_positions=2048)
    full = mem.step_bytes(deep, layout, micro, backward=True)["activations"]
    recomputed = mem.step_bytes(deep, layout, mem.MicroBatchShape(4096, 2048, recompute=True), True)
    assert recomputed["activations"] < full / 3  # each layer's input kept, one layer recomputed at a time
    split = mem.step_bytes(deep, mem.TrainLayout(backend="fsdp", world=2, sp=2), micro, backward=True)
    assert split["activations"] < full / 2  # half the tokens and no dense (tokens x tokens) mask


def test_shape_counts_what_the_checkpoint_holds(tmp_path):
    from transformers import AutoModelForCausalLM

    from backends.lora import wrap_lora

    path = save_tiny_qwen2(str(tmp_path / "m"), with_tokenizer=False)
    shape = mem.model_shape(ModelConfig(path=path))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert shape.params == shape.trainable == sum(p.numel() for p in model.parameters())
    assert (shape.hidden, shape.layers, shape.vocab) == (
        model.config.hidden_size,
        model.config.num_hidden_layers,
        model.config.vocab_size,
    )
    lora = ModelConfig(path=path, lora_rank=4)
    wrapped = wrap_lora(model, lora)
    assert mem.model_shape(lora).trainable == sum(p.numel() for p in wrapped.parameters() if p.requires_grad)


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
def test_plan_is_within_a_quarter_of_a_real_step(tmp_path, recompute):
    """A real fsdp engine (one rank, float32, packed sdpa), two training steps, measured with torch's allocator:
    the plan's peak (states + the larger of activations-and-logits or gradients) is within 25% of it."""
    torch.manual_seed(0)
    overrides = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=512, vocab_size=2048)
    path = save_tiny_qwen2(str(tmp_path / "m"), with_tokenizer=False, **overrides)
    batch = make_batch(8, 64, 192, vocab_size=2048, min_prompt=32, min_response=96)
    measured, micro = engine_step_peak("fsdp", path, batch, recompute=recompute)
    plan = sum(mem.train_peak(mem.model_shape(ModelConfig(path=path)), mem.TrainLayout("fsdp", 1), micro).values())
    assert 0.75 <= plan / measured <= 1.25, (plan, measured)


def test_a_vision_language_models_shape_counts_its_vision_tower(tmp_path):
    """Qwen2.5-VL's class is not AutoModelForCausalLM's: the shape comes from the model class the engines load."""
    from transformers import AutoModelForImageTextToText

    from scaletrain.models.tiny_vlm import save_tiny_qwen2_5_vl

    path = save_tiny_qwen2_5_vl(tmp_path / "vlm")
    shape = mem.model_shape(ModelConfig(path=str(path)))
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.vocab == model.config.text_config.vocab_size


def test_a_mixture_of_experts_counts_every_expert_and_the_top_k_activations():
    """States hold all the experts; a token's activations span only its top-k experts (top-2 of 4 here)."""
    from scaletrain.models.tiny import tiny_config

    config = tiny_config("qwen3_moe", 99, 0, 1, 2, shape="embedded")
    shape = mem.model_shape(ModelConfig(path="unused"), config)
    experts = config.num_hidden_layers * config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size
    assert shape.params > experts and shape.intermediate == 2 * config.moe_intermediate_size
    assert mem.model_shape(ModelConfig(path="unused"), tiny_config("qwen3", 99, 0, 1, 2)).intermediate == 128
