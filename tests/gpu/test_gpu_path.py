"""The CUDA path, on one GPU (``make test-gpu``; each test skips, saying why, without CUDA).

- each backend's PPO update equals the single-process reference on CUDA: fp32 (TF32 off) within 1e-4, and with
  the default bf16 mixed precision within 5e-2 relative on the loss and grad norm;
- after a weight sync, vLLM (bf16, CUDA graphs, sleep mode) samples with log-probs the trainer reproduces within
  a mean |diff| of 2e-2 per token (bf16 on both sides), going through the real sleep / wake lifecycle;
- 5 GRPO steps per backend on SmolLM2-135M-Instruct in bf16 (the recipe of launch/recipes), with vLLM where its
  CUDA build is installed, else transformers' generate (named in the figures);
- rollout TP=2 where 2 GPUs exist.
Figures (actor MFU, rollout tokens/s, weight-sync GiB/s, peak GPU memory) are printed and written to
``$SCALETRAIN_GPU_REPORT`` (default: gpu_report.json in the pytest temp dir).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.backends.multirank import assert_close, assert_ranks_passed, launch, rank_check, run_checks

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (make test-gpu on a GPU machine)")]
ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("fsdp", "deepspeed", "megatron")
FIGURES: dict[str, float] = {}


def record(name: str, value: float) -> None:
    FIGURES[name] = value
    print(f"[gpu figure] {name} = {value:.4g}")
    path = Path(os.environ.get("SCALETRAIN_GPU_REPORT", "gpu_report.json"))
    path.write_text(
        json.dumps({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), **FIGURES}, indent=1)
    )


# -------------------------------------------------------------------------------------- backend vs reference
@pytest.mark.parametrize("backend", BACKENDS)
def test_ppo_update_matches_reference_on_cuda(backend, tmp_path):
    from tests.backends.tiny import save_tiny_qwen2

    save_tiny_qwen2(str(tmp_path / "model"), seed=0, initializer_range=0.1)
    (tmp_path / "backend").write_text(backend)
    results = launch("tests.gpu.test_gpu_path", tmp_path, 1, timeout_s=300)
    for check in ("update_fp32", "update_bf16", *(["offload_frees_memory"] if backend == "megatron" else [])):
        assert_ranks_passed(results, check)


def run_rank(work: str) -> None:
    run_checks(work, _update_checks)


def _update_checks(work: str, rank: int, results: dict) -> None:
    from transformers import AutoModelForCausalLM

    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig, OptimConfig
    from tests.backends import reference
    from tests.backends.tiny import make_batch

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    backend = get_backend(Path(work, "backend").read_text())
    model_dir = os.path.join(work, "model")
    optim = OptimConfig(lr=1e-3, eps=1e-6, grad_clip=1.0)
    batch = make_batch(8, 12, 10, seed=1)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    ref_loss, ref_norm = reference.ref_step(ref, batch.to("cuda"), reference.actor_loss, reference.ref_outputs, optim)
    ref_sd = {k: v.detach().float().cpu() for k, v in ref.state_dict().items()}

    def step(dtype: str, mixed: str | None):
        engine = backend(
            ModelConfig(path=model_dir, dtype=dtype),
            optim,
            EngineConfig(micro_batch_size_per_gpu=4, mixed_precision=mixed),
        )
        metrics = engine.train_step(batch, reference.actor_loss, ("log_probs", "entropy"))
        weights = {k: v.float().cpu() for bucket in engine.export_weights(1 << 30) for k, v in bucket}
        return metrics, weights

    @rank_check(results, "update_fp32")
    def _():
        metrics, weights = step("float32", None)
        assert_close(torch.tensor(metrics["loss"]), torch.tensor(ref_loss), "loss", tol=1e-4)
        assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(ref_norm), "grad_norm", tol=1e-4 * ref_norm)
        for k, v in weights.items():
            assert_close(v, ref_sd[k], f"weight {k}", tol=1e-4)

    @rank_check(results, "update_bf16")
    def _():
        metrics, _ = step("auto", "auto")  # the CUDA default: fp32 master weights, bf16 compute
        assert abs(metrics["loss"] - ref_loss) <= 5e-2 * abs(ref_loss), (metrics["loss"], ref_loss)
        assert abs(metrics["grad_norm"] - ref_norm) <= 5e-2 * ref_norm, (metrics["grad_norm"], ref_norm)

    if Path(work, "backend").read_text() == "megatron":

        @rank_check(results, "offload_frees_memory")
        def _():
            offload = dict(param_offload=True, grad_offload=True, optimizer_offload=True)
            config = EngineConfig(micro_batch_size_per_gpu=4, **offload)
            engine = backend(ModelConfig(path=model_dir), optim, config)  # bf16 compute, fp32 main weights
            engine.train_step(batch, reference.actor_loss, ("log_probs", "entropy"))
            between = torch.cuda.memory_allocated()  # after the step: everything offloaded again
            engine.onload()
            held = torch.cuda.memory_allocated()
            engine.offload()
            params = sum(p.numel() for p in engine.module.parameters())
            # bf16 weights (2 bytes), fp32 main weights, gradients and Adam's two moments (4 each)
            freed = held - between
            record("megatron offload freed MiB (tiny model)", freed / 2**20)
            assert freed >= 0.9 * params * 18, (freed, params)
            assert torch.cuda.memory_allocated() <= between + (1 << 20), (torch.cuda.memory_allocated(), between)


# ----------------------------------------------------------------------------------- vLLM after a weight sync
def test_vllm_log_probs_match_trainer_after_sync(smollm2_dir, tmp_path):
    pytest.importorskip("vllm")
    (tmp_path / "model").symlink_to(smollm2_dir)
    out = subprocess.run(
        [sys.executable, "-c", f"from tests.gpu.test_gpu_path import vllm_rank; vllm_rank({str(tmp_path)!r})"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        env={
            **os.environ,
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29533",
            "PYTHONPATH": str(ROOT),
        },
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    figures = json.loads((tmp_path / "vllm_figures.json").read_text())
    for name, value in figures.items():
        record(name, value)
    assert figures["vllm_vs_trainer_abs_diff_mean"] < 2e-2, figures


def vllm_rank(work: str) -> None:
    """One process: the FSDP actor (bf16 compute) and vLLM (bf16) on one GPU, through the worker's lifecycle."""
    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig, OptimConfig
    from backends.rollout.base import RolloutConfig, SamplingConfig, get_rollout
    from scaletrain.workers.colocated_rollout import ColocatedRollout
    from tests.backends.tiny import make_batch

    model = os.path.join(work, "model")
    actor = get_backend("fsdp")(
        ModelConfig(path=model), OptimConfig(lr=1e-5), EngineConfig(micro_batch_size_per_gpu=16)
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = get_rollout("vllm")(
        RolloutConfig(model_path=model, max_model_len=512, gpu_memory_utilization=0.4, max_num_seqs=64), tokenizer
    )
    rollout = ColocatedRollout(engine, actor, free_cache_engine=True, offload_trainer=True, bucket_bytes=256 << 20)
    rollout.release()
    batch = make_batch(8, 16, 16, seed=0, vocab_size=tokenizer.vocab_size)
    for _ in range(2):  # an update moves the weights away from the checkpoint's
        actor.train_step(batch, _nll, ("log_probs",))
    rollout.release()
    start = time.perf_counter()
    nbytes = rollout.push_weights()  # the bytes the actor exported (its fp32 weights), not an assumed dtype's
    torch.cuda.synchronize()
    sync_s = time.perf_counter() - start
    prompts = _prompts(tokenizer)
    start = time.perf_counter()
    out = rollout.generate(prompts, SamplingConfig(n=8, temperature=1.0, max_new_tokens=128, seed=1))
    gen_s = time.perf_counter() - start
    rollout.release()
    trainer = actor.forward(out, ("log_probs",)).batch["log_probs"]
    mask = out.batch["response_mask"].bool()
    diff = (trainer - out.batch["rollout_log_probs"]).abs()[mask]
    figures = {
        "vllm_vs_trainer_abs_diff_mean": float(diff.mean()),
        "vllm_vs_trainer_abs_diff_max": float(diff.max()),
        "weight_sync_gib_per_s": nbytes / sync_s / 2**30,
        "rollout_tokens_per_s": float(mask.sum()) / gen_s,
        "lifecycle_moves": float(len(rollout.lifecycle.history)),
    }
    Path(work, "vllm_figures.json").write_text(json.dumps(figures))


def _nll(outputs, mb):
    m = mb.batch["response_mask"].float()
    return -(outputs["log_probs"] * m).sum() / m.sum(), {}


def _prompts(tokenizer):
    from scaletrain.protocol import DataProto

    texts = [f"What is {a} + {b}? Answer with the number." for a, b in [(12, 7), (30, 45), (8, 9), (123, 77)]]
    rows = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        for t in texts
    ]
    rows = [r["input_ids"] if isinstance(r, dict) else r for r in rows]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    )


# ---------------------------------------------------------------------------------------- GRPO on SmolLM2
@pytest.mark.parametrize("backend", BACKENDS)
def test_grpo_five_steps_smollm2(backend, smollm2_dir, tmp_path):
    # vLLM where it is installed; else transformers' generate (a GPU machine without vLLM's CUDA build), named in
    # the figures: the update, the sync and the log-prob agreement are the trainer's either way
    rollout = "vllm" if importlib.util.find_spec("vllm") else "hf"
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        BACKEND=backend,
        ROLLOUT=rollout,
        STEPS="5",
        TEST_FREQ="-1",
        TRAIN_SIZE="64",
        TEST_SIZE="16",
        OUT=str(tmp_path),
    )
    overrides = [
        "trainer.n_gpus_per_node=1",
        "trainer.device=cuda",
        "trainer.plot_at_end=false",
        "trainer.save_hf_at_end=false",
        "actor_rollout_ref.rollout.kv_cache_bytes=null",
        "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        "data.max_response_length=128",
    ]
    out = subprocess.run(
        [str(ROOT / "launch/recipes/smollm2_reasoning_gym.sh"), *overrides],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / f"chain_sum_{backend}" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [row for row in rows if row["step"] > 0]
    assert [row["step"] for row in steps] == [1, 2, 3, 4, 5]
    last = steps[-1]
    name = f"{backend}_{rollout}"
    record(f"{name}_log_prob_abs_diff_mean", last["rollout_corr/log_prob_abs_diff_mean"])
    record(f"{name}_actor_mfu", last["perf/mfu/actor"])
    tokens = last["response_length/mean"] * 16 * 8
    record(f"{name}_rollout_tokens_per_s", tokens / last["timing_s/gen"])
    record(f"{name}_step_s", last["timing_s/step"])
    record(f"{name}_weight_sync_gib_per_s", last["perf/weight_sync_bytes"] / last["perf/weight_sync_s"] / 2**30)
    record(f"{name}_peak_allocated_gib", max(row["perf/max_memory_allocated_gb"] for row in steps))
    record(f"{name}_peak_reserved_gib", max(row["perf/max_memory_reserved_gb"] for row in steps))
    assert last["rollout_corr/log_prob_abs_diff_mean"] < 2e-2, last["rollout_corr/log_prob_abs_diff_mean"]


# -------------------------------------------------------------------------------------------- rollout TP=2
def test_rollout_tp2_on_two_gpus(task, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"rollout TP=2 needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    pytest.importorskip("vllm")
    # SmolLM2's 9 attention heads cannot be split by 2 ranks: the embedded task's model (4 heads, 2 KV heads) with its
    # own data (a model of another tokenizer made every prompt longer than the data's max_prompt_length)
    from tests.trainer.runs import command, env, metrics

    run_dir = tmp_path / "run"
    extra = [
        "rollout=vllm",
        "trainer.n_gpus_per_node=2",
        "trainer.device=cuda",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "trainer.plot_at_end=false",
    ]
    out = subprocess.run(
        command(task, run_dir, 2, extra), env=env(), cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    steps = metrics(run_dir)
    assert [s for s in sorted(steps) if s > 0] == [1, 2]
    assert steps[2]["rollout_corr/log_prob_abs_diff_mean"] < 2e-2
