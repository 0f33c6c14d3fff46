"""The vision-language check the FSDP and DeepSpeed engine tests run on their 2 gloo ranks: the tiny Qwen2.5-VL on a
batch with images (tests/backends/vlm_batch.py), each rank holding half of the rows.

- forward, padded and packed: every response token's log-prob and entropy equal the row's own unpadded forward in
  plain transformers (fp32, 1e-4);
- one train step equals a single-process step on the whole batch (plain HF model, torch AdamW, the same token-mean
  loss): loss, gradient norm and every weight, the vision tower's included (which the step must change);
- with ``freeze_vision_tower`` a step changes no vision-tower weight and trains the language model;
- a VLM critic's values and a VLM reward model's scores, padded and packed, equal each row's own forward.
"""

from __future__ import annotations

import os

import torch

from tests.backends.multirank import assert_close

TOL = 1e-4


def check_vlm_engine(ctx, backend: str, **engine_settings) -> None:
    from transformers import AutoModelForImageTextToText

    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig, OptimConfig
    from tests.backends import reference
    from tests.backends.vlm_batch import reference_log_probs, vlm_batch

    model_dir = os.path.join(ctx.inputs, "vlm")
    batch = vlm_batch(ctx.inputs)
    half = len(batch) // 2
    share = batch.select_idxs(list(range(ctx.rank * half, (ctx.rank + 1) * half)))
    optim = OptimConfig(lr=1e-3, eps=1e-3, weight_decay=0.01, grad_clip=1.0, total_steps=4)
    ref = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = reference_log_probs(ref, share)
    ref_loss, ref_norm = reference.ref_step(ref, batch, reference.actor_loss, reference_log_probs, optim)
    Engine = get_backend(backend)
    for packed in (False, True):
        settings = EngineConfig(micro_batch_size_per_gpu=2, **engine_settings)
        engine = Engine(ModelConfig(path=model_dir, use_remove_padding=packed), optim, settings)
        out = engine.forward(share, ("log_probs", "entropy")).batch
        for name in ("log_probs", "entropy"):
            assert_close(out[name], expected[name], f"{backend} packed={packed} {name}", tol=TOL)
    before = {k: v for bucket in engine.export_weights(1 << 30) for k, v in bucket}
    metrics = engine.train_step(share, reference.actor_loss, ("log_probs", "entropy"))
    assert_close(torch.tensor(metrics["loss"]), torch.tensor(ref_loss), f"{backend} loss", tol=TOL)
    assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(ref_norm), f"{backend} grad_norm", tol=TOL)
    after = {k: v for bucket in engine.export_weights(1 << 30) for k, v in bucket}
    ref_sd = ref.state_dict()
    for name, weight in after.items():
        assert_close(weight, ref_sd[name], f"{backend} weight {name}", tol=TOL)
    vision = [name for name in after if ".visual." in name or name.startswith("visual.")]
    assert vision and any(not torch.equal(before[n], after[n]) for n in vision), "the vision tower did not train"
    settings = EngineConfig(micro_batch_size_per_gpu=2, **engine_settings)
    check_frozen_vision_tower(Engine, model_dir, share, optim, settings)
    check_vlm_heads(Engine, ctx.inputs, share, settings, backend)


def check_vlm_heads(Engine, inputs: str, share, settings, backend: str) -> None:
    """A VLM critic's values and a VLM reward model's scores, padded and packed, equal each row's own forward."""
    from backends.config import ModelConfig
    from backends.hf_model import build_model
    from tests.backends.vlm_batch import reference_head_outputs

    for kind, name in (("value", "values"), ("reward", "scores")):
        path = os.path.join(inputs, f"vlm_{kind}")
        with torch.no_grad():
            expected = reference_head_outputs(build_model(ModelConfig(path=path, kind=kind, dtype="float32")), share)
        for packed in (False, True):
            engine = Engine(ModelConfig(path=path, kind=kind, use_remove_padding=packed), None, settings)
            out = engine.forward(share, (name,)).batch[name]
            assert_close(out, expected[name], f"{backend} {kind} packed={packed}", tol=TOL)


def check_frozen_vision_tower(Engine, model_dir: str, share, optim, settings) -> None:
    """``freeze_vision_tower``: a step leaves every vision-tower weight as it was and trains the language model."""
    from backends.config import ModelConfig
    from tests.backends import reference

    engine = Engine(ModelConfig(path=model_dir, freeze_vision_tower=True), optim, settings)
    before = {k: v.clone() for bucket in engine.export_weights(1 << 30) for k, v in bucket}
    engine.train_step(share, reference.actor_loss, ("log_probs", "entropy"))
    after = {k: v for bucket in engine.export_weights(1 << 30) for k, v in bucket}
    changed = {name for name in after if not torch.equal(before[name], after[name])}
    vision = {name for name in after if ".visual." in name or name.startswith("visual.")}
    assert vision and not changed & vision, f"frozen vision tower weights changed: {sorted(changed & vision)[:3]}"
    assert changed - vision, "the language model did not train"
