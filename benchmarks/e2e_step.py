"""Tokens/s of a full GRPO step (64 prompts x 8 samples x 128 response tokens) through the whole stack, split by
phase, and the share of the step spent outside generation and training (controller overhead).

    python benchmarks/e2e_step.py [--quick] [--rollout vllm|hf] [--steps N] [key=value ...]

Trailing ``key=value`` arguments are trainer config overrides (dotted keys, as for main_ppo), e.g.
``ray_init.address=10.0.0.1:6379 trainer.nnodes=2 trainer.n_gpus_per_node=1`` to run on an existing multi-node
Ray cluster; launch/run.sh passes exactly those with ``ENTRY=benchmarks.e2e_step``, and
launch/testing/bench_slurm.sh compares 1 and 2 nodes on the one-machine SLURM test cluster.

The model is a tiny random Qwen2 (head_dim 32, 256 positions) with the embedded character tokenizer, so responses
run to the full 128 tokens; every phase (vLLM generation, reward, log-probs, FSDP update on 2 ranks, weight sync)
does its real work.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_results  # noqa: E402

WORKER_PHASES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor", "sync_weights")


def build_model(root: Path) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from scaletrain.data.tokenizer import build_arithmetic_tokenizer

    tok = build_arithmetic_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    path = str(root / "model")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def with_overrides(config: dict, overrides: list[str]) -> dict:
    """``config`` with dotted ``key=value`` overrides applied (values parsed as YAML, as Hydra does)."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.create(config), OmegaConf.from_dotlist(overrides))
    return OmegaConf.to_container(merged, resolve=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="16 prompts x 4 samples x 32 tokens")
    parser.add_argument("--rollout", default="vllm")
    parser.add_argument("--steps", type=int, default=4, help="measured steps (after 2 warm-up steps)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="trainer config overrides, e.g. ray_init.address=HOST:PORT trainer.nnodes=2",
    )
    args = parser.parse_args()
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must be key=value, got {bad}")
    return args


def step_config(root: Path, model: str, train_file: str, shape: tuple[int, int, int], rollout: str, steps: int):
    """The trainer config of the benchmark run: ``shape`` = (prompts, samples, response tokens), no validation,
    checkpoints or end-of-run extras, metrics to ``root/run/metrics.jsonl``."""
    prompts, n, resp = shape
    return {
        "data": {
            "train_files": train_file,
            "val_files": None,
            "train_batch_size": prompts,
            "max_prompt_length": 8,
            "max_response_length": resp,
        },
        "actor_rollout_ref": {
            "model": {"path": model},
            "actor": {"ppo_mini_batch_size": prompts, "ppo_micro_batch_size_per_gpu": 64},
            "rollout": {"name": rollout, "n": n, "response_length": resp, "prompt_length": 8},
        },
        "trainer": {
            "total_training_steps": steps,
            "default_local_dir": str(root / "run"),
            "logger": ["jsonl"],
            "val_before_train": False,
            "save_freq": -1,
            "test_freq": -1,
            "save_hf_at_end": False,
            "plot_at_end": False,
            "resume_mode": "disable",
        },
    }


def report(mean: dict[str, float], where: str) -> None:
    """Print the per-phase table and the overhead shares of the mean step; emit the results (``where`` tags them
    with the layout when it is not the default one node x 2 ranks)."""
    step_s = mean["timing_s/step"]
    tokens = mean["perf/total_num_tokens"]
    print(f"{'phase':<16}{'s':>9}{'share':>9}")
    for key in sorted(k for k in mean if k.startswith("timing_s/") and k != "timing_s/step"):
        print(f"{key.split('/', 1)[1]:<16}{mean[key]:>9.3f}{mean[key] / step_s:>8.1%}")
    print(f"{'step':<16}{step_s:>9.3f}")
    print(f"tokens/s (whole step, all ranks): {tokens / step_s:,.0f}")
    gen_train = mean.get("timing_s/gen", 0) + mean.get("timing_s/update_actor", 0)
    workers = sum(mean.get(f"timing_s/{p}", 0) for p in WORKER_PHASES)
    print(f"share outside generation and training: {1 - gen_train / step_s:.1%}")
    print(f"controller overhead (driver work + transport, outside every worker call): {1 - workers / step_s:.1%}")
    emit_results(
        [
            (f"e2e GRPO step{where}", step_s * 1e3, None, ""),
            (f"e2e tokens/s{where}", tokens / step_s, None, "", "tok/s"),
            (f"e2e controller overhead share{where}", (1 - workers / step_s) * 100, None, "", "%"),
        ]
    )


def main() -> None:
    args = parse_args()
    prompts, n, resp = (16, 4, 32) if args.quick else (64, 8, 128)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("scaletrain").setLevel(logging.INFO)  # e.g. where the worker group's ranks run

    from scaletrain.data.embedded import write_arithmetic_task
    from scaletrain.trainer.main_ppo import run_ppo

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(root)
        data = write_arithmetic_task(root / "data", seed=0, n_train=prompts * (args.steps + 2), n_val=8, n_test=8)
        config = step_config(root, model, data["train"], (prompts, n, resp), args.rollout, args.steps + 2)
        config = with_overrides(config, args.overrides)
        trainer = config["trainer"]
        nnodes, per_node = trainer.get("nnodes", 1), trainer.get("n_gpus_per_node", 2)
        summary = run_ppo(config)
        rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines() if line]
    measured = [r for r in rows if r["step"] > 2]
    mean = {k: sum(r.get(k, 0.0) for r in measured) / len(measured) for k in measured[0]}
    print(
        f"\nGRPO step: {prompts} prompts x {n} samples x {resp} response tokens, {args.rollout} rollout, "
        f"{nnodes * per_node} FSDP rank(s) on {nnodes} node(s), {len(measured)} steps measured "
        f"(run took {summary['wall_s']} s)"
    )
    report(mean, "" if (nnodes, per_node) == (1, 2) else f" ({nnodes} node(s) x {per_node} rank(s))")


if __name__ == "__main__":
    main()
