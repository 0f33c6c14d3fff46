"""Qwen3, Qwen3-MoE and Mixtral on the HF-model backends (FSDP2, DeepSpeed ZeRO-3; 2 gloo ranks each) and on
megatron (TP=2, PP=2, expert parallelism EP=2 on 2 ranks, EP=2 with TP=2 and whole experts (ETP=1) on 2, EP=2 x
TP=2 and PP=2 x TP=2 on 4), against plain transformers (one process, fp32, eager attention), on tiny random-init models
(scaletrain/models/tiny.py's ``test`` shape: 4 experts, top-2, in every layer of the MoE ones; random norm weights,
Qwen3's per-head q/k norms included).

- Reference, once in the test process per architecture: per-token log-probs / entropy of a batch, and the loss and
  gradient norm of one actor-loss step. For the MoE models the step adds the router losses
  (``router_aux_loss_coef`` 0.01, ``router_z_loss_coef`` 0.001): transformers' own load-balancing loss
  (``output_router_logits``) and the z-loss of its router logits, per data-parallel rank's rows, weighted by the
  rank's share of the response tokens (backends/accumulation.py). Megatron's router losses are its own (another
  definition: backends/megatron/moe_metrics.py), so its parity runs without them against the step without router
  terms, and ``router_losses`` (EP=2) checks that its coefficients act: the same policy loss, another gradient norm,
  and megatron's load-balancing loss, z-loss and load imbalance in the metrics equal to its definitions computed
  from transformers' router logits at the real tokens (the batch is padded; megatron's routers get the padding
  mask); the plain step's load imbalance equals it too wherever a router sees whole sequences (no TP).
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
from tests.backends.test_moe import hf_router_terms, routed_forward, tiny_model
from tests.backends.tiny import make_batch, make_tokenizer

TOL = 1e-4
LR = 1e-3
AUX, Z = 0.01, 0.001
MEGATRON_COEFS = (1.0, 0.1)  # large enough that their gradient moves the norm well past the parity tolerance
ARCHITECTURES = {"qwen3": False, "qwen3_moe": True, "mixtral": False}  # -> use_remove_padding
BACKENDS = (
    "fsdp",
    "deepspeed",
    "megatron_tp2",
    "megatron_pp2",
    "megatron_ep2",
    "megatron_ep2_tp2",
    "megatron_ep2_etp1",
    "megatron_pp2_tp2",
)
MEGATRON = {
    "megatron_tp2": {"tensor_model_parallel_size": 2},
    "megatron_pp2": {"pipeline_model_parallel_size": 2},
    "megatron_ep2": {"expert_model_parallel_size": 2},
    "megatron_ep2_tp2": {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2},
    # TP=2 for the dense layers, each expert whole (ETP=1) on one of the 2 EP ranks
    "megatron_ep2_etp1": {
        "expert_model_parallel_size": 2,
        "tensor_model_parallel_size": 2,
        "expert_tensor_parallel_size": 1,
    },
    # the second stage's routers get their sequence shard of the padding mask from the engine, not from megatron
    "megatron_pp2_tp2": {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2},
}
# Mixtral differs from Qwen3-MoE in names only (the mapping's table): one megatron layout covers it
MEGATRON_ARCHITECTURES = {
    "megatron_tp2": ("qwen3", "qwen3_moe"),
    "megatron_pp2": ("qwen3", "qwen3_moe"),
    "megatron_ep2": ("qwen3_moe", "mixtral"),
    "megatron_ep2_tp2": ("qwen3_moe",),
    "megatron_ep2_etp1": ("qwen3_moe",),
    "megatron_pp2_tp2": ("qwen3_moe",),
}
CHECKS = ("forward", "train_step", "export_reload")
EXTRA_CHECKS = {
    ("megatron_ep2", "qwen3_moe"): ("checkpoint", "router_losses"),
    ("megatron_ep2_tp2", "qwen3_moe"): ("checkpoint",),
}
WORLD = 2


def world(backend: str) -> int:
    return 4 if backend in ("megatron_ep2_tp2", "megatron_pp2_tp2") else WORLD


def megatron_layout(backend: str, architecture: str) -> dict:
    """The layout of a megatron case: a MoE model with TP runs sequence parallel (megatron trains it no other way)."""
    layout = MEGATRON[backend]
    tp = layout.get("tensor_model_parallel_size", 1) > 1
    return {**layout, "sequence_parallel": True} if tp and moe(architecture) else layout


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
    loss.backward()  # the step without router terms (megatron's parity)
    plain = {
        "loss_plain": float(loss),
        "grad_norm_plain": float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)),
    }
    model.zero_grad()
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
    if moe(architecture):  # megatron's definitions, per rank (its rows), averaged over the ranks
        with torch.no_grad():
            per_rank = [megatron_router_terms(model, batch.select_idxs(rank_rows(r))) for r in range(WORLD)]
        terms.update({f"megatron_{k}": sum(t[k] for t in per_rank) / WORLD for k in per_rank[0]})
    torch.save({**before, **terms, **plain, "loss": float(loss), "grad_norm": float(norm)}, path)


def megatron_router_terms(model, batch) -> dict[str, float]:
    """megatron-core's router terms of ``batch`` at its real tokens, from transformers' router logits, averaged over
    the layers (backends/megatron/moe_metrics.py): the load-balancing loss E / (k T^2) sum_e P_e n_e (P_e the summed
    softmax scores of expert e, n_e its top-k assignments, T the tokens), the z-loss mean logsumexp^2 and the load
    imbalance max_e n_e / mean_e n_e."""
    out, config = routed_forward(model, batch), model.config
    real = batch.batch["attention_mask"].reshape(-1).bool()
    experts, k = config.num_experts, config.num_experts_per_tok
    aux, z, imbalance = [], [], []
    for logits in out.router_logits:
        logits = logits[real].float()
        scores = logits.softmax(-1)
        n = torch.zeros_like(scores).scatter(1, scores.topk(k, dim=-1).indices, 1.0).sum(0)
        aux.append(float(experts / (k * len(logits) ** 2) * (scores.sum(0) * n).sum()))
        z.append(float(torch.logsumexp(logits, -1).square().mean()))
        imbalance.append(float(n.max() / n.mean()))
    return {name: sum(v) / len(v) for name, v in (("aux", aux), ("z", z), ("imbalance", imbalance))}


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
            groups[backend] = RankGroup("tests.backends.test_moe_parity", moe_models, world(backend), timeout_s=300)
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
        for c in CHECKS + EXTRA_CHECKS.get((b, a), ())
        if b not in MEGATRON or a in MEGATRON_ARCHITECTURES[b]
    ],
)
def test_backend(backend, architecture, check, backend_group):
    if backend != "fsdp":
        pytest.importorskip("megatron.core" if backend in MEGATRON else backend)
    backend_group(backend).assert_passed(check, backend, architecture)


# ---------------------------------------------------------------------------------- set-up the checks share
def engine_state(ctx, backend: str, architecture: str, router_losses: bool | None = None):
    """The engine of ``backend`` and ``architecture`` (with the router losses: by default on the HF backends'
    MoE models only)."""
    if router_losses is None:
        router_losses = moe(architecture) and backend not in MEGATRON

    def build():
        from backends.base import get_backend
        from backends.config import EngineConfig, ModelConfig, OptimConfig

        settings = json.loads(open(os.path.join(ctx.inputs, "settings.json")).read())[architecture]
        reference = torch.load(settings["reference"])
        aux, z = (AUX, Z) if backend not in MEGATRON else MEGATRON_COEFS
        coefs = dict(router_aux_loss_coef=aux, router_z_loss_coef=z) if router_losses else {}
        model = ModelConfig(path=settings["model_dir"], use_remove_padding=ARCHITECTURES[architecture], **coefs)
        extra = {"megatron": megatron_layout(backend, architecture)} if backend in MEGATRON else {}
        engine_class = get_backend("megatron" if backend in MEGATRON else backend)
        config = EngineConfig(micro_batch_size_per_gpu=4, extra=extra)
        engine = engine_class(model, OptimConfig(lr=LR, grad_clip=1.0), config)
        rows = rank_rows(engine.dp_rank, engine.dp_size)
        before = {k: reference[k][rows] for k in ("log_probs", "entropy")}
        return SimpleNamespace(engine=engine, share=the_batch().select_idxs(rows), before=before, reference=reference)

    return ctx.once(f"{backend}/{architecture}/{router_losses}", build)


def stepped(ctx, backend: str, architecture: str):
    def step():
        from tests.backends import reference as ref

        s = engine_state(ctx, backend, architecture)
        metrics = s.engine.train_step(s.share, ref.actor_loss, ("log_probs", "entropy"))
        want = s.reference
        if backend in MEGATRON:  # without router losses: the plain step
            want = {**want, "loss": want["loss_plain"], "grad_norm": want["grad_norm_plain"]}
        assert abs(metrics["loss"] - want["loss"]) <= TOL, (metrics["loss"], want["loss"])
        assert abs(metrics["grad_norm"] - want["grad_norm"]) <= TOL * want["grad_norm"], (metrics, want["grad_norm"])
        if backend in MEGATRON and moe(architecture):
            assert "router_aux_loss" not in metrics and 1.0 <= metrics["router_load_imbalance"] <= 2.0, metrics
            if "tensor_model_parallel_size" not in MEGATRON[backend]:  # whole sequences on each router: exact
                imbalance = (metrics["router_load_imbalance"], want["megatron_imbalance"])
                assert abs(imbalance[0] - imbalance[1]) <= 1e-4 * imbalance[1], imbalance
        elif moe(architecture):
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


def check_checkpoint(ctx, backend: str, architecture: str) -> None:
    """Expert-parallel checkpoint: the offline reader (the model merger's) gives the exported tensors bit for bit,
    and a resume after another step brings back the saved weights (the same log-probs)."""
    import torch.distributed as dist

    from backends.checkpoint.meta import CHECKPOINT_READERS, read_checkpoint_meta
    from backends.megatron.export import gather_hf_buckets
    from tests.backends import reference as ref

    engine, s = stepped(ctx, backend, architecture), engine_state(ctx, backend, architecture)
    path = os.path.join(ctx.work, f"ckpt_{backend}_{architecture}")
    engine.save(path)
    saved = engine.forward(s.share, ("log_probs",)).batch["log_probs"]
    # the reader gives the model's in-memory names (fused experts), as the engine's gathering does
    exported = {name: t.clone() for bucket in gather_hf_buckets(engine, 1 << 20) for name, t in bucket}
    verdict: list = [None]  # rank 0 reads; every rank fails with its verdict (none is left in a collective)
    if ctx.rank == 0:
        reader = CHECKPOINT_READERS.get("megatron")
        read = {n: t for b in reader(path, read_checkpoint_meta(path), list(engine.hf_meta), 1 << 20) for n, t in b}
        unequal = [n for n in exported if n not in read or not torch.equal(read[n], exported[n])]
        verdict[0] = (unequal or sorted(set(read) ^ set(exported)))[:5] or None
    dist.broadcast_object_list(verdict, src=0)
    assert verdict[0] is None, f"the offline reader differs from the export: {verdict[0]}"
    engine.train_step(s.share, ref.actor_loss, ("log_probs", "entropy"))
    assert (engine.forward(s.share, ("log_probs",)).batch["log_probs"] - saved).abs().max() > 20 * TOL
    engine.load(path)
    assert torch.equal(engine.forward(s.share, ("log_probs",)).batch["log_probs"], saved)


def check_router_losses(ctx, backend: str, architecture: str) -> None:
    """Megatron with router_aux_loss_coef / router_z_loss_coef: its own losses join the gradient, not the policy
    loss, and are logged."""
    from tests.backends import reference as ref

    s = engine_state(ctx, backend, architecture, router_losses=True)
    metrics = s.engine.train_step(s.share, ref.actor_loss, ("log_probs", "entropy"))
    want = s.reference
    assert abs(metrics["loss"] - want["loss_plain"]) <= TOL, (metrics["loss"], want["loss_plain"])
    assert abs(metrics["grad_norm"] - want["grad_norm_plain"]) > 20 * TOL * want["grad_norm_plain"], metrics
    # megatron's own terms, at the real tokens only (the batch is padded: counting the pads changes each of them)
    for key in ("aux", "z", "imbalance"):
        metric = "router_load_imbalance" if key == "imbalance" else f"router_{key}_loss"
        assert abs(metrics[metric] - want[f"megatron_{key}"]) <= 1e-4 * want[f"megatron_{key}"], (metric, metrics, want)


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
