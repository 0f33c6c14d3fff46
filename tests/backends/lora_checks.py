"""The rank side of tests/backends/test_lora_engine.py's 2-rank launches, and its single-process PEFT reference.

``run_rank(work)`` builds LoRA engines of the backend named in ``work/backend`` (fsdp | deepspeed) on the tiny
model at ``work/model``; each rank gets half of the batch rows, the reference (``peft_reference``: the same
LoraConfig and seed, so the adapter init matches; ``adapter_step``: torch AdamW on the adapter parameters only) the
whole batch. Every check of ``CHECKS`` records None or its failure (tests/backends/multirank.py).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch

from backends.config import ForwardOptions
from tests.backends.multirank import assert_close, rank_check, run_checks

WORLD = 2
RANK, ALPHA, SEED = 4, 16, 3  # scale alpha / r = 4: the merged deltas stand well above the tolerance
TOL = 1e-5
OUTPUTS = ("log_probs", "entropy")
CHECKS = (
    "optimizer_holds_adapters_only",
    "train_step_matches_peft_reference",
    "base_weights_unchanged",
    "merged_export_matches_merge_and_unload",
    "export_adapter",
    "disabled_adapter_forward_is_base",
    "save_hf_adapter_and_merged",
    "checkpoint_converts_to_adapter_and_merged",
    "adapter_path_remove_padding_forward_only",
    "value_model_trains_head",
    "resume_exact",
)

BASE_MODEL = ForwardOptions(base_model=True)  # the frozen base model's outputs (the adapters disabled)


def lora_model_config(path: str, **keys):
    from backends.config import ModelConfig

    return ModelConfig(path=path, **{"lora_rank": RANK, "lora_alpha": ALPHA, **keys})


def peft_reference(model_dir: str, kind: str = "causal_lm", seed: int = SEED):
    """The plain HF model wrapped by PEFT as the engine does it: the seed first, then the load and the adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    torch.manual_seed(seed)
    if kind == "causal_lm":
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        extra = {"task_type": "CAUSAL_LM"}
    else:
        config = AutoConfig.from_pretrained(model_dir, num_labels=1, classifier_dropout=0.0)
        base = AutoModelForTokenClassification.from_pretrained(model_dir, config=config, dtype=torch.float32)
        extra = {"task_type": "TOKEN_CLS", "exclude_modules": ["score"], "modules_to_save": ["score"]}
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0, **extra)
    return get_peft_model(base, config)


def adapter_step(model, data, loss_fn, outputs_fn, optim) -> tuple[float, float]:
    """One clipped torch AdamW step on the trainable (adapter) parameters of ``model``; (loss, grad norm)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay
    )
    loss, _ = loss_fn(outputs_fn(model, data), data)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, optim.grad_clip)
    opt.step()
    return float(loss), float(norm)


def exported(engine, bucket_bytes: int = 1 << 30) -> dict:
    return {k: v for bucket in engine.export_weights(bucket_bytes) for k, v in bucket}


def exported_adapter(engine, bucket_bytes: int = 1 << 30) -> dict:
    return {k: v for bucket in engine.export_adapter(bucket_bytes) for k, v in bucket}


def frozen_tensors(engine) -> dict:
    """The full (gathered) base weights of a LoRA engine under their PEFT names (collective)."""
    return {n: get() for n, _, get in engine._param_items() if ".lora_" not in n}


def optimizer_numel(engine) -> int:
    """Elements of AdamW's first moments (state the optimizer holds), over all ranks; after a step."""
    import torch.distributed as dist

    if hasattr(engine, "ds"):  # ZeRO-3: torch AdamW on this rank's flat fp32 partitions
        local = sum(s["exp_avg"].numel() for s in engine.optimizer.optimizer.state.values())
        total = torch.tensor([local])
        dist.all_reduce(total)
        return int(total)
    return sum(s["exp_avg"].numel() for s in engine.optimizer.state.values())  # DTensors: the global numel


def run_rank(work: str) -> None:
    run_checks(work, _run_checks)


def _run_checks(work: str, rank: int, results: dict) -> None:
    import torch.distributed as dist

    from tests.backends.tiny import make_batch

    s = _setup(work, rank)
    _step_checks(s, results)
    _export_checks(s, results)
    _save_and_reload_checks(s, results)
    _value_check(s, results)
    _resume_check(s, results, make_batch(8, 12, 10, seed=2).select_idxs(s.rows))
    dist.barrier()
    dist.destroy_process_group()


def _setup(work: str, rank: int) -> SimpleNamespace:
    """The reference step (whole batch, one process), then the engine of this rank (half of the rows)."""
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from backends.base import get_backend
    from backends.config import EngineConfig, OptimConfig
    from tests.backends import reference
    from tests.backends.tiny import make_batch

    s = SimpleNamespace(work=work, rank=rank, model_dir=os.path.join(work, "model"))
    s.E = get_backend(Path(work, "backend").read_text())
    # eps 1e-3: Adam's first step is ~lr * sign(grad); a larger eps keeps float noise on near-zero gradients
    # (a different reduction order across ranks) from being amplified into weight differences
    s.optim = OptimConfig(lr=1e-3, eps=1e-3, weight_decay=0.01, grad_clip=1.0, lr_scheduler="cosine", total_steps=4)
    s.batch = make_batch(8, 12, 10, seed=1)
    s.rows = list(range(rank * 4, rank * 4 + 4))
    s.share = s.batch.select_idxs(s.rows)
    s.base = AutoModelForCausalLM.from_pretrained(s.model_dir, dtype=torch.float32)
    with torch.no_grad():
        s.base_log_probs = reference.ref_outputs(s.base, s.share)["log_probs"]
    s.ref = peft_reference(s.model_dir)
    s.ref_loss, s.ref_norm = adapter_step(s.ref, s.batch, reference.actor_loss, reference.ref_outputs, s.optim)
    s.ref_adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(s.ref).items()}
    s.ref_merged = copy.deepcopy(s.ref).merge_and_unload().state_dict()
    s.engine = s.E(lora_model_config(s.model_dir), s.optim, EngineConfig(micro_batch_size_per_gpu=3, seed=SEED))
    s.trainable = [n for n, p in s.engine.model.named_parameters() if p.requires_grad]
    s.base_before = frozen_tensors(s.engine)
    return s


def _step_checks(s: SimpleNamespace, results: dict) -> None:
    from tests.backends import reference

    engine = s.engine

    @rank_check(results, "train_step_matches_peft_reference")
    def _():
        metrics = engine.train_step(s.share, reference.actor_loss, OUTPUTS)  # 2 micro-batches: 3 + 1 rows
        assert_close(torch.tensor(metrics["loss"]), torch.tensor(s.ref_loss), "loss")
        assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(s.ref_norm), "grad_norm")
        assert s.ref_norm > s.optim.grad_clip and metrics["step_skipped"] == 0.0, (s.ref_norm, metrics)
        adapter = exported_adapter(engine)
        assert list(adapter) == list(s.ref_adapter), "adapter names differ from PEFT's"
        for k, v in adapter.items():
            assert_close(v, s.ref_adapter[k], f"adapter {k}", TOL)

    @rank_check(results, "optimizer_holds_adapters_only")
    def _():
        assert s.trainable and all(".lora_A." in n or ".lora_B." in n for n in s.trainable), s.trainable
        assert engine.has_adapter and engine.adapter_bytes() == sum(v.numel() * 4 for v in s.ref_adapter.values())
        adapter_numel, full_numel = engine.adapter_bytes() // 4, sum(p.numel() for p in s.base.parameters())
        held = optimizer_numel(engine)
        assert adapter_numel <= held < adapter_numel + 256 and held < full_numel // 4, (held, adapter_numel)

    @rank_check(results, "base_weights_unchanged")
    def _():
        after = frozen_tensors(engine)
        assert list(after) == list(s.base_before)
        for k, v in after.items():
            assert torch.equal(v, s.base_before[k]), k


def _export_checks(s: SimpleNamespace, results: dict) -> None:
    from tests.backends import reference

    engine = s.engine

    @rank_check(results, "merged_export_matches_merge_and_unload")
    def _():
        weights = exported(engine)
        assert list(weights) == list(s.ref_merged) == list(s.base.state_dict()), "merged names are not the HF names"
        for k, v in weights.items():
            assert_close(v, s.ref_merged[k], f"merged {k}", TOL)
        q = "model.layers.0.self_attn.q_proj.weight"
        assert (weights[q] - s.base.state_dict()[q]).abs().max() > 100 * TOL, "the merge changed nothing"

    @rank_check(results, "export_adapter")
    def _():
        buckets = list(engine.export_adapter(2048))  # lora_A of q_proj: 1,024 B; lora_B of gate_proj: 2,048 B
        assert len(buckets) > 5
        for bucket in buckets:
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            assert size <= 2048 or len(bucket) == 1, (size, [n for n, _ in bucket])
        assert [n for bucket in buckets for n, _ in bucket] == list(s.ref_adapter)
        assert sum(t.numel() * t.element_size() for b in buckets for _, t in b) == engine.adapter_bytes()

    @rank_check(results, "disabled_adapter_forward_is_base")
    def _():
        on = engine.forward(s.share, ("log_probs",)).batch["log_probs"]
        with torch.no_grad():
            assert_close(on, reference.ref_outputs(s.ref, s.share)["log_probs"], "adapted log_probs", TOL)
        off = engine.forward(s.share, ("log_probs",), BASE_MODEL).batch["log_probs"]
        assert_close(off, s.base_log_probs, "adapter-disabled log_probs", TOL)
        assert (on - off).abs().max() > 1e-3, "the adapters changed nothing"
        assert [n for n, p in engine.model.named_parameters() if p.requires_grad] == s.trainable


def _save_and_reload_checks(s: SimpleNamespace, results: dict) -> None:
    import torch.distributed as dist
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from backends.config import EngineConfig
    from tests.backends.reference import ref_outputs

    adapter_dir, merged_dir = os.path.join(s.work, "adapter"), os.path.join(s.work, "merged")
    trained = s.engine.forward(s.share, ("log_probs",)).batch["log_probs"]

    @rank_check(results, "save_hf_adapter_and_merged")
    def _():
        s.engine.save_hf(adapter_dir)
        s.engine.save_hf(merged_dir, merged=True)
        weights = exported(s.engine)
        if s.rank == 0:
            files = set(os.listdir(adapter_dir))
            assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "config.json" not in files
            saved = json.loads(Path(adapter_dir, "adapter_config.json").read_text())
            assert (saved["r"], saved["lora_alpha"], saved["base_model_name_or_path"]) == (RANK, ALPHA, s.model_dir)
            plain = AutoModelForCausalLM.from_pretrained(s.model_dir, dtype=torch.float32)
            with torch.no_grad():
                loaded = ref_outputs(PeftModel.from_pretrained(plain, adapter_dir), s.share)["log_probs"]
            assert_close(loaded, trained, "PEFT-loaded adapter log_probs", TOL)
            assert "adapter_config.json" not in os.listdir(merged_dir)
            merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
            for k, v in merged.state_dict().items():
                assert torch.equal(v, weights[k]), k
            with torch.no_grad():
                assert_close(ref_outputs(merged, s.share)["log_probs"], trained, "merged model log_probs", TOL)
        dist.barrier()

    @rank_check(results, "checkpoint_converts_to_adapter_and_merged")
    def _():
        assert_lora_converts(s.engine, s.share, os.path.join(s.work, "convert"), s.rank, s.model_dir)

    @rank_check(results, "adapter_path_remove_padding_forward_only")
    def _():
        frozen = s.E(
            lora_model_config(s.model_dir, use_remove_padding=True, lora_adapter_path=adapter_dir),
            None,
            EngineConfig(use_dynamic_bsz=True, max_token_len_per_gpu=64),
        )
        out = frozen.forward(s.share, ("log_probs",)).batch["log_probs"]
        assert_close(out, trained, "adapter-path log_probs", TOL)
        off = frozen.forward(s.share, ("log_probs",), BASE_MODEL).batch["log_probs"]
        assert_close(off, s.base_log_probs, "adapter-path base log_probs", TOL)
        assert not any(p.requires_grad for p in frozen.model.parameters())


def _value_check(s: SimpleNamespace, results: dict) -> None:
    from backends.config import EngineConfig
    from tests.backends import reference

    @rank_check(results, "value_model_trains_head")
    def _():
        critic_ref = peft_reference(s.model_dir, "value", seed=7)
        head_before = critic_ref.base_model.model.score.original_module.weight.detach().clone()
        with torch.no_grad():
            before = reference.ref_values(critic_ref, s.share)["values"]
        loss, norm = adapter_step(critic_ref, s.batch, reference.value_loss, reference.ref_values, s.optim)
        critic = s.E(
            lora_model_config(s.model_dir, kind="value", use_remove_padding=True),
            s.optim,
            EngineConfig(micro_batch_size_per_gpu=3, seed=7),
        )
        assert_close(critic.forward(s.share, ("values",)).batch["values"], before, "values", TOL)
        metrics = critic.train_step(s.share, reference.value_loss, ("values",))
        assert_close(torch.tensor(metrics["loss"]), torch.tensor(loss), "value loss")
        assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(norm), "value grad_norm")
        weights, unloaded = exported(critic), critic_ref.merge_and_unload().state_dict()
        assert list(weights) == list(unloaded)
        for k, v in weights.items():
            assert_close(v, unloaded[k], f"critic merged {k}", TOL)
        assert (weights["score.weight"] - head_before).abs().max() > s.optim.lr / 2, "the value head did not train"
        assert_lora_converts(critic, s.share, os.path.join(s.work, "convert_critic"), s.rank, s.model_dir, "value")


def assert_lora_converts(engine, share, work: str, rank: int, model_dir: str, kind: str = "causal_lm") -> None:
    """The engine's checkpoint (its adapters alone) converted offline on rank 0 (scaletrain/model_merger): the
    PEFT adapter directory loads on the base and gives the engine's outputs; ``merge_lora`` gives the engine's
    merged export bit for bit (a value head kept), with the same outputs."""
    import torch.distributed as dist
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    from scaletrain.model_merger import merge
    from tests.backends import reference

    ckpt = os.path.join(work, "ckpt")
    engine.save(ckpt)
    weights = exported(engine)
    key = "log_probs" if kind == "causal_lm" else "values"
    own = engine.forward(share, (key,)).batch[key]
    outputs = reference.ref_outputs if kind == "causal_lm" else reference.ref_values
    if rank == 0:
        merged = merge(ckpt, os.path.join(work, "merged"), merge_lora=True, shard_bytes=1 << 16)
        model_class = AutoModelForCausalLM if kind == "causal_lm" else AutoModelForTokenClassification
        model = model_class.from_pretrained(merged, dtype=torch.float32)
        assert sorted(model.state_dict()) == sorted(weights)
        for k, v in model.state_dict().items():
            assert torch.equal(v, weights[k]), k
        with torch.no_grad():
            assert_close(outputs(model, share)[key], own, f"merged checkpoint's {key}", TOL)
        adapter = merge(ckpt, os.path.join(work, "adapter"))
        config = AutoConfig.from_pretrained(model_dir, num_labels=1, classifier_dropout=0.0)
        base = model_class.from_pretrained(model_dir, config=config, dtype=torch.float32)
        with torch.no_grad():
            assert_close(outputs(PeftModel.from_pretrained(base, adapter), share)[key], own, f"adapter's {key}", TOL)
    dist.barrier()


def saved_model_tensors(ckpt: str) -> list[str]:
    """The model tensors an engine checkpoint holds: DCP's (fsdp), or the parameters DeepSpeed ZeRO-3 saves (the
    optimizer's partitions, ``param_shapes``, and the frozen ones, ``frozen_param_shapes``)."""
    if os.path.isdir(os.path.join(ckpt, "dcp")):
        import torch.distributed.checkpoint as dcp

        meta = dcp.FileSystemReader(os.path.join(ckpt, "dcp")).read_metadata().state_dict_metadata
        return [k for k, v in meta.items() if k.startswith("model.") and getattr(v, "size", None)]
    names = []
    for path in Path(ckpt).rglob("*model_states.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)
        names += [k for shapes in state["param_shapes"] for k in shapes]
        names += list(state.get("frozen_param_shapes") or {})
    return names


def _resume_check(s: SimpleNamespace, results: dict, later) -> None:
    from backends.config import EngineConfig
    from tests.backends import reference

    ckpt = os.path.join(s.work, "ckpt")

    @rank_check(results, "resume_exact")
    def _():
        s.engine.save(ckpt)  # after step 1 (collective: every rank's files are written when it returns)
        saved = saved_model_tensors(ckpt)
        assert saved and all(".lora_" in name for name in saved), saved  # the adapters (and their state) alone
        draw = torch.rand(4)
        first = s.engine.train_step(later, reference.actor_loss, OUTPUTS)
        first_adapter, first_weights = exported_adapter(s.engine), exported(s.engine)
        # another seed: another adapter init, which the checkpoint must overwrite
        config = EngineConfig(micro_batch_size_per_gpu=3, seed=SEED + 1)
        fresh = s.E(lora_model_config(s.model_dir), s.optim, config)
        fresh.load(ckpt)
        assert torch.equal(torch.rand(4), draw), "RNG state not restored"
        assert fresh.global_step == 1
        second = fresh.train_step(later, reference.actor_loss, OUTPUTS)
        assert first == second, (first, second)  # bit-exact: loss, grad norm, learning rate
        assert first["lr"] < s.optim.lr, first  # the cosine schedule resumed
        for k, v in exported_adapter(fresh).items():
            assert torch.equal(v, first_adapter[k]), k
        for k, v in exported(fresh).items():
            assert torch.equal(v, first_weights[k]), k
