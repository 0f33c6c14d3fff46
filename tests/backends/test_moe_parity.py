"""Qwen3, Qwen3-MoE and Mixtral on the HF-model backends (FSDP2, DeepSpeed ZeRO-3; 2 gloo ranks each), and Qwen3 on
megatron (TP=2, PP=2), against plain transformers (one process, fp32, eager attention), on tiny random-init models
(scaletrain/models/tiny.py's ``test`` shape: 4 experts, top-2, in every layer of the MoE ones; random norm weights,
Qwen3's per-head q/k norms included).

- Reference, once in the test process per architecture: per-token log-probs / entropy of a batch, and the loss and
  gradient norm of one actor-loss step. For the MoE models the step adds the router losses
  (``router_aux_loss_coef`` 0.01, ``router_z_loss_coef`` 0.001): transformers' own load-balancing loss
  (``output_router_logits``) and the z-loss of its router logits, per data-parallel rank's rows, weighted by the
  rank's share of the response tokens (backends/accumulation.py).
- Per backend and architecture: forward log-probs equal the reference (<= 1e-4); the step gives the reference loss,
  gradient norm and router metrics; after it, ``save_hf`` writes the checkpoint layout (per-expert tensors, as
  ``save_pretrained``) and ``from_pretrained`` of it gives every exported tensor bit for bit and the engine's own
  post-step log-probs (<= 1e-4). Qwen3-MoE runs packed (``use_remove_padding``), the others padded.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from tests.backends.multirank import assert_close
from tests.backends.rank_group import RankGroup
from tests.backends.test_moe import hf_router_terms, tiny_model
from tests.backends.tiny import make_batch, make_tokenizer

TOL = 1e-4
LR = 1e-3
AUX, Z = 0.01, 0.001
ARCHITECTURES = {"qwen3": False, "qwen3_moe": True, "mixtral": False}  # -> use_remove_padding
BACKENDS = ("fsdp", "deepspeed", "megatron_tp2", "megatron_pp2")
MEGATRON = {"megatron_tp2": {"tensor_model_parallel_size": 2}, "megatron_pp2": {"pipeline_model_parallel_size": 2}}
MEGATRON_ARCHITECTURES = ("qwen3",)  # megatron maps no mixture of experts yet
CHECKS = ("forward", "train_step", "export_reload")
WORLD = 2


def moe(architecture: str) -> bool:
    return architecture != "qwen3"


def the_batch():
    return make_batch(batch_size=8, prompt_len=10, response_len=8, seed=3)


def rank_rows(rank: int, world: int = WORLD) -> list[int]:
    per = len(the_batch()) // world
    return list(range(rank * per, (rank + 1) * per))


def write_reference(model_dir: str, architecture: str, path: str) -> None:
    """Outputs before the step; the step's loss (with the router losses, each rank's rows weighted by their
    response tokens), its gradient norm and the weighted router terms."""
    from transformers import AutoModelForCausalLM

    from tests.backends import reference as ref

    batch = the_batch()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        before = ref.ref_outputs(model, batch)
    loss, _ = ref.actor_loss(ref.ref_outputs(model, batch), batch)
    terms = {"router_aux_loss": 0.0, "router_z_loss": 0.0}
    if moe(architecture):
        total = ref.response_tokens(batch)
        for rank in range(WORLD):
            share = batch.select_idxs(rank_rows(rank))
            aux, z = hf_router_terms(model, share)
            weight = ref.response_tokens(share) / total
            loss = loss + weight * (AUX * aux + Z * z)
            terms["router_aux_loss"] += weight * float(aux)
            terms["router_z_loss"] += weight * float(z)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    torch.save({**before, **terms, "loss": float(loss), "grad_norm": float(norm)}, path)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """The work directory: a model and its reference per architecture, and settings.json naming them."""
    work = tmp_path_factory.mktemp("moe_parity")
    settings = {}
    for architecture in ARCHITECTURES:
        model_dir = str(work / architecture)
        tiny_model(architecture).save_pretrained(model_dir)
        make_tokenizer().save_pretrained(model_dir)
        reference = str(work / f"{architecture}_reference.pt")
        write_reference(model_dir, architecture, reference)
        settings[architecture] = {"model_dir": model_dir, "reference": reference}
    (work / "settings.json").write_text(json.dumps(settings))
    return work


@pytest.fixture(scope="module")
def backend_group(moe_models):
    groups: dict[str, RankGroup] = {}

    def group(backend: str) -> RankGroup:
        for other in [b for b in groups if b != backend]:
            groups.pop(other).close()
        if backend not in groups:
            groups[backend] = RankGroup("tests.backends.test_moe_parity", moe_models, WORLD, timeout_s=300)
        return groups[backend]

    yield group
    for g in groups.values():
        g.close()


@pytest.mark.parametrize(
    "backend, architecture, check",
    [
        (b, a, c)
        for b in BACKENDS
        for a in ARCHITECTURES
        for c in CHECKS
        if b not in MEGATRON or a in MEGATRON_ARCHITECTURES
    ],
)
def test_backend(backend, architecture, check, backend_group):
    if backend != "fsdp":
        pytest.importorskip("megatron.core" if backend in MEGATRON else backend)
    backend_group(backend).assert_passed(check, backend, architecture)


# ---------------------------------------------------------------------------------- set-up the checks share
def engine_state(ctx, backend: str, architecture: str):
    def build():
        from backends.base import get_backend
        from backends.config import EngineConfig, ModelConfig, OptimConfig

        settings = json.loads(open(os.path.join(ctx.inputs, "settings.json")).read())[architecture]
        reference = torch.load(settings["reference"])
        coefs = dict(router_aux_loss_coef=AUX, router_z_loss_coef=Z) if moe(architecture) else {}
        model = ModelConfig(path=settings["model_dir"], use_remove_padding=ARCHITECTURES[architecture], **coefs)
        extra = {"megatron": MEGATRON[backend]} if backend in MEGATRON else {}
        engine_class = get_backend("megatron" if backend in MEGATRON else backend)
        config = EngineConfig(micro_batch_size_per_gpu=4, extra=extra)
        engine = engine_class(model, OptimConfig(lr=LR, grad_clip=1.0), config)
        rows = rank_rows(engine.dp_rank, engine.dp_size)
        before = {k: reference[k][rows] for k in ("log_probs", "entropy")}
        return SimpleNamespace(engine=engine, share=the_batch().select_idxs(rows), before=before, reference=reference)

    return ctx.once(f"{backend}/{architecture}", build)


def stepped(ctx, backend: str, architecture: str):
    def step():
        from tests.backends import reference as ref

        s = engine_state(ctx, backend, architecture)
        metrics = s.engine.train_step(s.share, ref.actor_loss, ("log_probs", "entropy"))
        want = s.reference
        assert abs(metrics["loss"] - want["loss"]) <= TOL, (metrics["loss"], want["loss"])
        assert abs(metrics["grad_norm"] - want["grad_norm"]) <= TOL * want["grad_norm"], (metrics, want["grad_norm"])
        if moe(architecture):
            for key in ("router_aux_loss", "router_z_loss"):
                assert abs(metrics[key] - want[key]) <= 1e-5, (key, metrics[key], want[key])
            assert 1.0 <= metrics["router_load_imbalance"] <= 2.0, metrics
        else:
            assert "router_aux_loss" not in metrics, metrics
        return s.engine

    return ctx.once(f"{backend}/{architecture}/stepped", step)


# ------------------------------------------------------------------------------------------ per-rank checks
def check_forward(ctx, backend: str, architecture: str) -> None:
    s = engine_state(ctx, backend, architecture)
    assert s.engine.global_step == 0, "the engine has stepped already: run the checks in CHECKS' order"
    out = s.engine.forward(s.share, ("log_probs", "entropy")).batch
    assert_close(out["log_probs"], s.before["log_probs"], "log_probs", tol=TOL)
    assert_close(out["entropy"], s.before["entropy"], "entropy", tol=TOL)


def check_train_step(ctx, backend: str, architecture: str) -> None:
    stepped(ctx, backend, architecture)


def check_export_reload(ctx, backend: str, architecture: str) -> None:
    """save_hf -> the files hold the checkpoint layout; from_pretrained -> every exported tensor bit for bit
    (compared on rank 0) and the engine's post-step log-probs."""
    import torch.distributed as dist
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from backends.checkpoint.hf_names import checkpoint_layout
    from tests.backends import reference as ref

    engine, s = stepped(ctx, backend, architecture), engine_state(ctx, backend, architecture)
    after = engine.forward(s.share, ("log_probs",)).batch["log_probs"]
    assert (after - s.before["log_probs"]).abs().max() > 20 * TOL, "the step left the log-probs unchanged"
    hf_dir = os.path.join(ctx.work, f"hf_{backend}_{architecture}")
    engine.save_hf(hf_dir)
    exported = {name: tensor.clone() for bucket in engine.export_weights(1 << 20) for name, tensor in bucket}
    try:  # rank 0 compares; the other waits for it, whatever its verdict (a failed assert must not leave it waiting)
        if ctx.rank == 0:
            with safe_open(os.path.join(hf_dir, "model.safetensors"), framework="pt") as f:
                saved = set(f.keys())
            assert saved == set(exported) - {"lm_head.weight"}, sorted(
                saved ^ set(exported)
            )  # tied: the head is not saved
            if moe(architecture):
                assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in saved), sorted(saved)
            loaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
            state = dict(p for b in checkpoint_layout([list(loaded.state_dict().items())], loaded) for p in b)
            unequal = [n for n, t in exported.items() if not torch.equal(state[n], t)]
            assert sorted(state) == sorted(exported) and not unequal, unequal[:5]
            with torch.no_grad():
                reloaded = ref.ref_outputs(loaded, s.share)["log_probs"]
            assert_close(reloaded, after, "reloaded log_probs", tol=TOL)
    finally:
        dist.barrier()
