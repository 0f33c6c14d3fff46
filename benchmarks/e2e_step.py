"""Tokens/s of a full GRPO step (64 prompts x 8 samples x 128 response tokens) through the whole stack, split by
phase; the share of the step spent outside generation and training (controller overhead); and the step against
its limit: the same work done by plain tools in the same run (benchmarks/e2e_limit.py).

    python benchmarks/e2e_step.py [--quick] [--rollout vllm|hf] [--steps N] [--no-limit] [key=value ...]

Trailing ``key=value`` arguments are trainer config overrides (dotted keys, as for main_ppo), e.g.
``ray_kwargs.ray_init.address=10.0.0.1:6379 trainer.nnodes=2 trainer.n_gpus_per_node=1`` to run on an existing
multi-node Ray cluster; launch/run.sh passes exactly those with ``ENTRY=benchmarks.e2e_step``, and
launch/testing/bench_slurm.sh compares 1 and 2 nodes on the one-machine SLURM test cluster.

Model, tokenizer and sampling (``build_model``): a tiny random Qwen2 (hidden 128, 2 layers, 4 heads / 2 KV heads,
intermediate 512, 256 positions, tied embeddings, float32) with a byte-level BPE tokenizer of 512 tokens trained
here on synthetic text (``build_bpe_tokenizer``; ``<pad> <bos> <eos> <unk>`` = ids 0-3; digits one token each, as
in Qwen2's tokenizer, so a prompt ``"437+258="`` is 8 tokens). Sampling is the rollout default: temperature 1, no
top-k / top-p, EOS ends a response. A random model's next-token distribution is near uniform, so with 512 tokens
EOS would still end about 1 response in 5 early (with the 16-character arithmetic tokenizer used before, most
responses ended after ~20 tokens). So the model's EOS logit is pushed ~17 below the others (hidden dimension 0 of
every embedding set to 1, the EOS row's to -1), which leaves the distribution over the other tokens as it was.
A model-side fix rather than a sampling flag: the rollout config has no ``ignore_eos`` / ``min_tokens`` key,
and it holds for any peer generating from the same checkpoint (benchmarks/peers/trl_step.py). Every response
then runs to the full 128 tokens; still, the figures count the response tokens actually generated (the batch's
response mask: ``response_length/mean`` x rows), never rows x 128, and print the mean / min length.

Every phase (vLLM generation, reward, old log-probs, FSDP update on 2 ranks, weight sync) does its real work.
The limit (skipped with ``--no-limit`` or on a Ray cluster given by ``ray_kwargs.ray_init.address``): raw ``vllm.LLM``
generate of the same prompts and lengths + a plain torch forward/backward/AdamW loop over the same tokens + a plain
no-grad forward (the old log-probs), each on the same ranks x threads as the step; printed as step / sum
(target <= 1.2x).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_results  # noqa: E402

MAIN_PHASES = ("gen", "old_log_prob", "update_actor")  # the phases the limit and the peers compare
WORKER_PHASES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor", "sync_weights")
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0-3, as in the embedded arithmetic tokenizer
BPE_VOCAB = 512
PROMPT_LENGTH = 8  # "437+258=": one token per character (digits are split one by one)
MICRO_BATCH = 64  # rows per forward / backward, in the update and the old-log-prob pass
CHAT_TEMPLATE = "{%- for message in messages -%}{{- message['content'] -}}{%- endfor -%}"  # bare prompt text


def build_bpe_tokenizer(vocab_size: int = BPE_VOCAB):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of ``vocab_size`` tokens, trained (seeded, < 1 s) on 20,000
    synthetic lines: an addition problem of the task (``"437+258=695"``) and three pseudo-words. Digits are split
    one by one before BPE, as Qwen2's pre-tokenizer does: ``AutoTokenizer`` loads a directory with a Qwen2
    ``config.json`` as a ``Qwen2Tokenizer``, which keeps this vocabulary and merges but applies its own split,
    so training with the same split makes the built and the loaded tokenizer agree (8 tokens for ``"437+258="``);
    the pseudo-words supply the merges."""
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng(0)
    syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    lines = [
        f"{a}+{b}={a + b} " + " ".join("".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(3))
        for a, b in rng.integers(100, 1000, (20_000, 2)).tolist()
    ]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no <unk> in practice
        show_progress=False,
    )
    core.train_from_iterator(lines, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.model_max_length, tok.chat_template = 256, CHAT_TEMPLATE
    if len(tok) != vocab_size or tok.eos_token_id != 2:
        raise RuntimeError(f"BPE training gave {len(tok)} tokens, EOS id {tok.eos_token_id}")
    return tok


def build_model(root: Path) -> str:
    """Write the benchmark's tiny random Qwen2 and its BPE tokenizer to ``root/model`` (see the module docstring
    for why EOS is pushed down); returns the path."""
    import torch
    from transformers import Qwen2ForCausalLM

    from scaletrain.models.tiny import tiny_qwen2_config

    tok = build_bpe_tokenizer()
    torch.manual_seed(0)
    ids = (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    cfg = tiny_qwen2_config(len(tok), *ids, shape="embedded", max_position_embeddings=256)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        # dimension 0 then dominates the residual stream, the final norm's output is large and positive there,
        # and with tied embeddings the EOS logit ends up far below every other token's (all shifted alike)
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 1.0
        emb[tok.eos_token_id, 0] = -1.0
    path = str(root / "model")
    model.save_pretrained(path)
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
    parser.add_argument("--no-limit", action="store_true", help="skip the limit (plain tools, same work)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="trainer config overrides, e.g. ray_kwargs.ray_init.address=HOST:PORT trainer.nnodes=2",
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
            "max_prompt_length": PROMPT_LENGTH,
            "max_response_length": resp,
        },
        "actor_rollout_ref": {
            "model": {"path": model},
            "actor": {"ppo_mini_batch_size": prompts, "ppo_micro_batch_size_per_gpu": MICRO_BATCH},
            "rollout": {
                "name": rollout,
                "n": n,
                "response_length": resp,
                "prompt_length": PROMPT_LENGTH,
                # the old-log-prob pass in the same micro-batches as the update (the default is 8 rows)
                "log_prob_micro_batch_size_per_gpu": MICRO_BATCH,
            },
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


def phase_table(mean: dict[str, float], generated: float) -> None:
    """The mean step's phases: seconds, share of the step, generated tokens per second of the phase."""
    step_s = mean["timing_s/step"]
    print(f"{'phase':<16}{'s':>9}{'share':>9}{'gen tok/s':>12}")
    for key in sorted(k for k in mean if k.startswith("timing_s/") and k != "timing_s/step"):
        rate = f"{generated / mean[key]:>12,.0f}" if mean[key] > 0.01 * step_s else ""  # not for tiny phases
        print(f"{key.split('/', 1)[1]:<16}{mean[key]:>9.3f}{mean[key] / step_s:>8.1%}{rate}")
    print(f"{'step':<16}{step_s:>9.3f}{'':>9}{generated / step_s:>12,.0f}")


def report(mean: dict[str, float], rows: int, where: str, limit: dict[str, float] | None) -> None:
    """Print the per-phase table, the overhead shares and the step against its limit; emit the results
    (``where`` tags them with the layout when it is not the default one node x 2 ranks)."""
    from benchmarks.e2e_limit import FORWARD, GEN, TRAIN

    step_s = mean["timing_s/step"]
    per_response = mean["response_length/mean"]
    generated = per_response * rows  # the batch's response mask: the tokens actually generated
    print(
        f"generated tokens per response: mean {per_response:.1f}, min {mean['response_length/min']:.0f} "
        f"(clipped at the length limit: {mean['response_length/clip_ratio']:.0%}); {generated:,.0f} per step"
    )
    phase_table(mean, generated)
    gen_train = mean.get("timing_s/gen", 0) + mean.get("timing_s/update_actor", 0)
    workers = sum(mean.get(f"timing_s/{p}", 0) for p in WORKER_PHASES)
    # the wording launch/testing/bench_slurm.sh greps for
    print(f"tokens/s (whole step, all ranks): {generated / step_s:,.0f} (generated tokens)")
    print(f"share outside generation and training: {1 - gen_train / step_s:.1%}")
    print(f"controller overhead (driver work + transport, outside every worker call): {1 - workers / step_s:.1%}")
    results = [
        (f"e2e GRPO step{where}", step_s * 1e3, None, ""),
        (f"e2e generated tokens/s{where}", generated / step_s, None, "", "tok/s"),
        (f"e2e generated tokens per response{where}", per_response, None, "", "tokens"),
        (f"e2e controller overhead share{where}", (1 - workers / step_s) * 100, None, "", "%"),
    ]
    results += [(f"e2e phase {p}{where}", mean.get(f"timing_s/{p}", 0.0) * 1e3, None, "") for p in MAIN_PHASES]
    if limit:
        total = sum(limit.values())
        print("\nthe step against the limit (the same work by plain tools, this run; target <= 1.2x):")
        pairs = [("gen", GEN), ("update_actor", TRAIN), ("old_log_prob", FORWARD)]
        for phase, part in pairs:
            ours = mean.get(f"timing_s/{phase}", 0.0)
            print(f"  {phase:<14}{ours:>8.3f} s  vs {part:<30}{limit[part]:>8.3f} s  {ours / limit[part]:>5.2f}x")
            results.append((f"e2e {phase} vs {part}{where}", ours * 1e3, limit[part] * 1e3, part))
        print(f"  {'step':<14}{step_s:>8.3f} s  vs {'limit (sum)':<30}{total:>8.3f} s  {step_s / total:>5.2f}x")
        results.append((f"e2e step vs limit{where}", step_s * 1e3, total * 1e3, "raw gen + plain fwd/bwd + fwd"))
    emit_results(results)


def measure(args, root: Path, model: str, data: dict, shape: tuple[int, int, int], world: int):
    """The limit's seconds per part (benchmarks/e2e_limit.py) for the step's work; None when skipped."""
    from benchmarks.e2e_limit import Work, measure_limit, prompt_ids

    prompts, n, resp = shape
    work = Work(
        model=model,
        prompts=prompt_ids(data["train"], model, prompts),
        n=n,
        response_length=resp,
        prompt_length=PROMPT_LENGTH,
        micro_batch=MICRO_BATCH,
        world=world,
        repeats=2 if args.quick else 3,
    )
    print(f"\nmeasuring the limit: {world} process(es) x 1 thread, {work.warmup} warm-up + {work.repeats} runs each")
    start = time.perf_counter()
    limit = measure_limit(work)
    print(f"limit measured in {time.perf_counter() - start:.0f} s")
    return limit


def main() -> None:
    args = parse_args()
    shape = (16, 4, 32) if args.quick else (64, 8, 128)
    prompts, n, resp = shape
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("scaletrain").setLevel(logging.INFO)  # e.g. where the worker group's ranks run

    from scaletrain.data.embedded import write_arithmetic_task
    from scaletrain.trainer.main_ppo import run_ppo

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(root)
        data = write_arithmetic_task(root / "data", seed=0, n_train=prompts * (args.steps + 2), n_val=8, n_test=8)
        config = step_config(root, model, data["train"], shape, args.rollout, args.steps + 2)
        config = with_overrides(config, args.overrides)
        trainer = config["trainer"]
        nnodes, per_node = trainer.get("nnodes", 1), trainer.get("n_gpus_per_node", 2)
        summary = run_ppo(config)  # its private Ray cluster is shut down at its end
        rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines() if line]
        limit = None
        # the limit runs on this machine: only for a local run, once the step's Ray cluster has let the cores go
        if not args.no_limit and not config.get("ray_kwargs", {}).get("ray_init", {}).get("address") and nnodes == 1:
            limit = measure(args, root, model, data, shape, per_node)
    measured = [r for r in rows if r["step"] > 2]
    mean = {k: sum(r.get(k, 0.0) for r in measured) / len(measured) for k in measured[0]}
    print(
        f"\nGRPO step: {prompts} prompts x {n} samples x {resp} response tokens, {args.rollout} rollout, "
        f"{nnodes * per_node} FSDP rank(s) on {nnodes} node(s), {len(measured)} steps measured "
        f"(run took {summary.wall_s} s)"
    )
    where = "" if (nnodes, per_node) == (1, 2) else f" ({nnodes} node(s) x {per_node} rank(s))"
    report(mean, prompts * n, where, limit)


if __name__ == "__main__":
    main()
