"""A whole GRPO step on TRL's GRPOTrainer against benchmarks/e2e_step.py's, at the same shape: tokens/s and s/step.

    .venv-peers/bin/python benchmarks/peers/trl_step.py [--quick] [--steps N] [--procs P] [--threads T] [--ours]

Runs in .venv-peers (benchmarks/peers/setup_venv.sh; TRL is imported only there, at benchmark time, and no TRL code
is copied here). Without ``--ours`` it measures TRL alone and prints its figures as the baseline (``ours`` null);
with ``--ours`` it also runs benchmarks/e2e_step.py with the same shape in .venv (a subprocess, ``--no-limit``),
reads that script's ``BENCH_JSON`` line and prints both, with the ratios.

The same work on both sides:

- model and tokenizer: e2e_step's ``build_model`` (tiny random Qwen2, hidden 128, 2 layers, byte-level BPE of 512
  tokens, EOS logit pushed down so every response runs to the length limit), written to a temporary directory
  and loaded by TRL from there (float32);
- batch: 64 prompts x 8 generations x 128 completion tokens (``--quick``: 16 x 4 x 32), the arithmetic task's
  prompts (``scaletrain.data.embedded.write_arithmetic_task``, seed 0), one optimizer step per GRPO step
  (``per_device_train_batch_size`` 64 = e2e_step's micro-batch, ``gradient_accumulation_steps`` = rows / (64 x
  processes));
- sampling: temperature 1.0, top-p 1.0, no top-k, EOS stops a completion (both sides' defaults);
- reward: a cheap Python function, exact match of the stripped completion text with the answer (the shape of
  ours, scaletrain/reward/scorers/arithmetic.py);
- optimisation: AdamW, lr 1e-6, no weight decay, gradient clipping 1.0, clip epsilon 0.2, no KL term and no
  reference model (TRL ``beta=0``; ours runs without a ref), token-mean loss (TRL ``loss_type="dapo"``), std-
  normalised group advantages (``scale_rewards="group"``), float32, no gradient checkpointing; no old-log-prob
  forward (TRL trains each batch once against its own detached log-probs; ours runs in rollout correction's bypass
  mode, ``algorithm.rollout_correction.bypass_mode=true``: the rollout's log-probs are the old ones);
- counting: the completion tokens actually generated: TRL hands the reward function each completion's ids cut
  after the first EOS (the EOS kept, as our response mask does); e2e_step reports ``response_length/mean`` x rows;
- timing: 2 warm-up steps, then ``--steps`` measured ones (default 4, ``--quick`` 2), each from the end of the
  previous optimizer step to the end of this one (a TrainerCallback), so it holds generation, reward, the loss
  passes and the optimizer step; the generate calls are timed on their own too;
- threads: the same 2 cores (``--threads``, 2 in all) in the same layout as ours (2 FSDP ranks x 1 thread): by
  default TRL runs as 2 data-parallel processes of 1 thread each (``--procs 2``; this script starts the ranks
  with LOCAL_RANK / WORLD_SIZE set, so Accelerate runs DDP over gloo on CPU; each rank generates and trains on
  half of the batch, as ours). ``--procs 1`` is TRL's plain single-process launch with 2 torch threads; it
  measured slower here (generate 4.9 s vs 3.4 s per step), likely because transformers' generate of a model this
  small is bound by per-token Python work, which a second thread does not share.

TRL's settings: ``use_vllm=False`` (generation with transformers' ``generate``, as the issue measured; TRL's vLLM
modes are not tried here), ``use_transformers_continuous_batching=False``, ``num_iterations=1``,
``shuffle_dataset=False``, ``use_cpu=True``, ``bf16=False``, ``logging_steps=1``, ``report_to="none"``,
``ddp_find_unused_parameters=False``, no checkpoints. TRL's processes run at niceness 15, the niceness Ray gives
our ranks.

Differences that remain: ours recomputes the old log-probs in a separate forward pass every step (our config
has no bypass for it), while TRL with ``num_iterations=1`` reuses the current log-probs detached and skips that
pass; ours also syncs weights to vLLM every step and moves the batch between the driver and the ranks (Ray);
ours seeds every sampling request (reproducibility), TRL samples from the global RNG; with ``--procs 1`` the
parallel layout differs as said above (1 process x 2 threads vs ours 2 processes x 1 thread).

Rows (the ``BENCH_JSON`` row format; ``ratio`` = ours / baseline): the s/step row (lower is better, ``target``
0.667: ours at least 1.5x TRL's tokens/s, since both sides generate the same tokens per step), generated
tokens/s (higher is better; target >= 1.5 said in the note), generation seconds per step and generated tokens
per response.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TRL_NAME = "TRL GRPOTrainer (HF generate)"
WARMUP = 2
MICRO_BATCH = 64  # e2e_step's micro-batch (rows per forward / backward)
TOKENS_TARGET = 1.5  # ours / TRL generated tokens/s
MARKER = "BENCH_JSON "
RAY_WORKER_NICENESS = int(os.environ.get("RAY_worker_niceness", "15"))  # our ranks' niceness (Ray's default)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 prompts x 4 samples x 32 tokens, 2 steps")
    parser.add_argument("--steps", type=int, default=None, help="measured steps after 2 warm-up (default 4, quick 2)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (default 2: the 2 cores)")
    parser.add_argument("--procs", type=int, default=2, help="TRL processes (data parallel over gloo; default 2)")
    parser.add_argument("--rank-out", type=Path, default=None, help=argparse.SUPPRESS)  # a --procs child's file
    parser.add_argument("--ours", action="store_true", help="also run benchmarks/e2e_step.py in .venv")
    parser.add_argument("--ours-python", type=Path, default=ROOT / ".venv" / "bin" / "python")
    parser.add_argument("--ours-rollout", default="vllm", help="our side's rollout engine: vllm | hf (TRL's generate)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for our side's subprocess")
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.quick else 4)
    args.shape = (16, 4, 32) if args.quick else (64, 8, 128)
    return args


def set_threads(threads: int) -> None:
    """Every thread pool the TRL process may use gets ``threads`` (run.py's sides start with OMP_NUM_THREADS=1);
    the process takes Ray's worker niceness, as our ranks run at it, so both sides get the same share of the cores
    against any other load (on an idle machine this changes nothing)."""
    os.nice(max(0, RAY_WORKER_NICENESS - os.nice(0)))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    import torch

    torch.set_num_threads(threads)


def make_dataset(root: Path, prompts: int, steps: int):
    """The arithmetic task's first ``prompts x steps`` training prompts as a ``datasets.Dataset`` (conversational
    ``prompt`` + ``ground_truth``), the same rows e2e_step trains on."""
    import pyarrow.parquet as pq
    from datasets import Dataset

    from scaletrain.data.embedded import write_arithmetic_task

    files = write_arithmetic_task(root / "data", seed=0, n_train=prompts * steps, n_val=8, n_test=8)
    rows = pq.read_table(files["train"]).to_pylist()
    return Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows[: prompts * steps]]
    )


class Counters:
    """What the instrumented TRL run saw: completion tokens per step (from the reward calls), seconds per step
    (from a TrainerCallback) and per generate call."""

    def __init__(self) -> None:
        self.tokens: list[list[int]] = []  # per reward call (one per generation batch = one step): lengths
        self.step_s: list[float] = []
        self.generate_s: list[float] = []

    def reward(self, completions, ground_truth, completion_ids, **_) -> list[float]:
        """Exact match of the stripped completion text; records the completions' token counts."""
        self.tokens.append([len(ids) for ids in completion_ids])
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [1.0 if t.strip() == str(g).strip() else 0.0 for t, g in zip(texts, ground_truth)]

    def timed_generate(self, generate):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = generate(*args, **kwargs)
            self.generate_s.append(time.perf_counter() - start)
            return out

        return wrapper

    def callback(self):
        from transformers import TrainerCallback

        counters = self

        class StepTimer(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                self.last = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                now = time.perf_counter()
                counters.step_s.append(now - self.last)
                self.last = now

        return StepTimer()


def trl_config(out_dir: Path, shape: tuple[int, int, int], steps: int, procs: int):
    """GRPOConfig for one optimizer step per GRPO step of ``shape`` over ``procs`` processes (see the docstring)."""
    from trl import GRPOConfig

    prompts, n, resp = shape
    micro = min(MICRO_BATCH, prompts * n // procs)
    return GRPOConfig(
        output_dir=str(out_dir),
        max_steps=steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=prompts * n // (micro * procs),
        num_generations=n,
        max_completion_length=resp,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        use_transformers_continuous_batching=False,
        learning_rate=1e-6,
        weight_decay=0.0,
        max_grad_norm=1.0,
        epsilon=0.2,
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        shuffle_dataset=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,  # every parameter gets a gradient: spare DDP its extra graph traversal
        seed=0,
    )


def run_trl(shape: tuple[int, int, int], steps: int, procs: int) -> dict:
    """One TRL process's raw observations (this rank's share when ``procs`` > 1): seconds per step, per generate
    call, and this rank's completion lengths per step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from benchmarks.e2e_step import build_model

    prompts, n, _ = shape
    with tempfile.TemporaryDirectory(prefix="trl_step_") as tmp:
        root = Path(tmp)
        path = build_model(root)  # seeded: every rank builds the same model and tokenizer
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        counters = Counters()
        model.generate = counters.timed_generate(model.generate)  # instance attribute: TRL calls model.generate
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[counters.reward],
            args=trl_config(root / "out", shape, WARMUP + steps, procs),
            train_dataset=make_dataset(root, prompts, WARMUP + steps),
            processing_class=AutoTokenizer.from_pretrained(path),
            callbacks=[counters.callback()],
        )
        trainer.train()
    if len(counters.step_s) != WARMUP + steps or len(counters.tokens) != WARMUP + steps:
        raise RuntimeError(f"expected {WARMUP + steps} steps, saw {len(counters.step_s)} / {len(counters.tokens)}")
    return {"step_s": counters.step_s, "generate_s": counters.generate_s, "tokens": counters.tokens}


def run_ranks(args: argparse.Namespace) -> list[dict]:
    """``args.procs`` copies of this script as one torch.distributed group on this machine (Accelerate sees
    LOCAL_RANK / WORLD_SIZE and runs data parallel over gloo), ``threads / procs`` threads each; their raw
    observations."""
    from scaletrain.utils.net import free_port, local_rank_env

    port, threads = free_port(), max(1, args.threads // args.procs)
    with tempfile.TemporaryDirectory(prefix="trl_ranks_") as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(args.procs)]
        procs = []
        for rank, out in enumerate(outs):
            env = {**local_rank_env(rank, args.procs, port, str(ROOT)), "OMP_NUM_THREADS": str(threads)}
            cmd = [sys.executable, __file__, *sys.argv[1:], "--rank-out", str(out), "--threads", str(threads)]
            procs.append(subprocess.Popen([c for c in cmd if c != "--ours"], env=env, cwd=ROOT))
        codes = [p.wait(timeout=args.timeout) for p in procs]
        if any(codes):
            raise RuntimeError(f"TRL ranks exited with {codes}")
        return [json.loads(out.read_text()) for out in outs]


def summarize(ranks: list[dict]) -> dict:
    """TRL's figures over the measured steps from every rank's observations: rank 0's step and generate times
    (the ranks move in lockstep), the completion tokens of all ranks."""
    first = ranks[0]
    tokens = [sum(sum(r["tokens"][i]) for r in ranks) for i in range(WARMUP, len(first["tokens"]))]
    lengths = [x for r in ranks for step in r["tokens"][WARMUP:] for x in step]
    step_s = first["step_s"][WARMUP:]
    return {
        "step_s": statistics.mean(step_s),
        "generate_s": statistics.mean(first["generate_s"][WARMUP:]),
        "tokens_per_step": statistics.mean(tokens),
        "tokens_per_response": statistics.mean(lengths),
        "min_response": min(lengths),
        "tokens_per_s": sum(tokens) / sum(step_s),
    }


def run_ours(args: argparse.Namespace) -> dict:
    """benchmarks/e2e_step.py in .venv with the same shape and steps; its rows by measure."""
    cmd = [str(args.ours_python), str(ROOT / "benchmarks" / "e2e_step.py"), "--steps", str(args.steps), "--no-limit"]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--rollout", args.ours_rollout]
    # the same work as TRL's: trained once, each batch needs no old-log-prob forward (TRL takes the current
    # log-probs, detached, as the old ones; ours takes the rollout's: rollout_correction's bypass mode)
    cmd += ["algorithm.rollout_correction.bypass_mode=true"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # e2e_step's ranks: 1 thread each
    print(f"[trl_step] our side: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    rows = {}
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            rows.update({r["measure"]: r["ours"] for r in json.loads(line[len(MARKER) :])["rows"]})
        elif "pid=" not in line:  # e2e_step's own table, not the ranks' log lines
            print(f"  {line}")
    if proc.returncode != 0 or not rows:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise RuntimeError(f"e2e_step.py failed (exit {proc.returncode}):\n{tail}")
    return {
        "step_s": rows["e2e GRPO step"] / 1e3,
        "tokens_per_s": rows["e2e generated tokens/s"],
        "tokens_per_response": rows["e2e generated tokens per response"],
        "generate_s": rows["e2e phase gen"] / 1e3,
    }


def result_rows(shape: tuple[int, int, int], procs: int, trl: dict, ours: dict | None) -> list[dict]:
    """The rows, TRL as the baseline; ``ours`` None: TRL's figures alone."""
    tag = "x".join(map(str, shape))
    name = TRL_NAME if procs == 1 else f"{TRL_NAME}, {procs} processes"
    trl = dict(trl)
    ours = dict(ours or {})

    def row(measure: str, key: str, unit: str, scale: float = 1.0, **extra) -> dict:
        mine = ours.get(key)
        return {
            "measure": f"GRPO step {tag}: {measure}",
            "ours": None if mine is None else mine * scale,
            "baseline": trl[key] * scale,
            "baseline_name": name,
            "ratio": None if mine is None else mine / trl[key],
            "unit": unit,
            **extra,
        }

    for side in (trl, ours):  # everything but generation: the loss passes, the optimizer step, reward, transport
        if side:
            side["train_s"] = side["step_s"] - side["generate_s"]
    return [
        row("s/step", "step_s", "ms", 1e3, target=round(1 / TOKENS_TARGET, 3)),
        row("training half s/step (step - generate)", "train_s", "ms", 1e3, target=1.0),
        row("generated tokens/s", "tokens_per_s", "tok/s", note=f"higher is better; target >= {TOKENS_TARGET}x"),
        row("generate s/step", "generate_s", "ms", 1e3),
        row("generated tokens per response", "tokens_per_response", "tokens"),
    ]


def main() -> None:
    args = parse_args()
    if args.rank_out is not None:  # a child of run_ranks: this rank's observations to the file, nothing printed
        set_threads(args.threads)
        args.rank_out.write_text(json.dumps(run_trl(args.shape, args.steps, args.procs)))
        return
    if args.procs > 1:
        trl = summarize(run_ranks(args))
    else:
        set_threads(args.threads)
        trl = summarize([run_trl(args.shape, args.steps, 1)])
    print(
        f"\nTRL GRPOTrainer, {'x'.join(map(str, args.shape))}, {args.procs} process(es) x "
        f"{max(1, args.threads // args.procs)} thread(s), {args.steps} steps measured: {trl['step_s']:.3f} s/step "
        f"(generate {trl['generate_s']:.3f} s), {trl['tokens_per_s']:,.0f} generated tokens/s, "
        f"{trl['tokens_per_response']:.1f} tokens per response (min {trl['min_response']})",
        flush=True,
    )
    ours = run_ours(args) if args.ours else None
    rows = result_rows(args.shape, args.procs, trl, ours)
    if ours:
        ratio = ours["tokens_per_s"] / trl["tokens_per_s"]
        print(f"ours / TRL generated tokens/s: {ratio:.2f}x (target >= {TOKENS_TARGET}x)")
    print(MARKER + json.dumps({"rows": rows}), flush=True)


if __name__ == "__main__":
    main()
