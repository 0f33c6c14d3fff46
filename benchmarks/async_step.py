"""Samples/s and trainer idle share of sync, one-step-off and fully-async training on a long-tailed task, with
the same resources (one rollout rank + one train rank, split placement) and the same prompts per step.

    python benchmarks/async_step.py [--quick] [--rollout vllm|hf] [--steps N] [--partial] [key=value ...]

Trailing ``key=value`` arguments are trainer config overrides applied to every run (dotted keys, as for
main_ppo). The runs, one after the other in this process:

- ``sync``: ``async_training.mode=sync`` on split placement (generate, train, push the weights, in turn);
- ``one_step_off``: step k+1's rollout overlaps step k's training;
- ``fully_async``: a rollouter streams batches, ``staleness_threshold=1``, a push every step;
- ``fully_async+partial`` (``--partial``): the same with ``async_training.partial_rollout=true``.

The long tail: every trajectory goes through the ``long_tail_agent`` loop registered here, which asks the rollout
server for a length drawn deterministically from its request id (the same in every mode): about 7 in 8 get
around the median, 1 in 8 about 10x the median. The model is a tiny random Qwen2 (benchmarks/e2e_step.py's)
whose EOS logit is pushed far down, so responses run to the drawn length; the measured lengths are printed.
Each step: 8 prompts x 8 samples, median 16 response tokens, the long ones ~160 (cap 192); generation and the
actor's update take about as long on CPU. Default: 2 warm-up + 8 measured steps per mode (about 4-5 minutes on
2 CPU cores, most of it starting the workers), ``--quick``: 1 + 2 (about 3 minutes).

Measured (steady state: warm-up steps and the last step, which has no next rollout to overlap, are left out):
samples/s = trained samples / the sum of ``timing_s/step``; trainer idle share = the step's time waiting for
rollouts and weight pushes (sync: gen + reward + sync_weights; async: ``async/trainer_idle_s`` + sync_weights)
over the step time; rollout idle share (sync: the step's time outside generation; async:
``async/rollout_idle_s``); mean staleness; the weight push's GiB/s (bytes over the push's time, which includes
waiting for the engines' generate call in flight: low in fully_async without partial rollout); samples/s
relative to sync.

What to expect at scale: when rollout dominates and a few responses are much longer than the rest, sync waits
for gen + train every step, one_step_off for about max(gen, train), so its speed-up approaches
(gen + train) / max(gen, train) (up to 2x when they are equal); fully_async with partial rollout further stops
the weight push from waiting for the longest response in flight. On a 2-core CPU machine both ranks and the driver
share the cores, so overlapped phases slow each other down and the ratios are well below those on separate GPUs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_results  # noqa: E402
from benchmarks.e2e_step import build_model, step_config, with_overrides  # noqa: E402
from scaletrain.agent.base import AgentLoopOutput, register_agent_loop  # noqa: E402
from scaletrain.agent.single_turn import SingleTurnAgentLoop  # noqa: E402

LONG_EVERY = 8  # about 1 trajectory in LONG_EVERY is long ...
TAIL_FACTOR = 10  # ... about TAIL_FACTOR x the median
SPLIT = [  # the same resources in every mode: 1 train rank + 1 rollout rank; the same rollout path
    "actor_rollout_ref.hybrid_engine=false",
    "trainer.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.mode=async",
    "actor_rollout_ref.rollout.multi_turn.default_agent_loop=long_tail_agent",
    "actor_rollout_ref.model.use_remove_padding=true",  # training cost follows the real tokens, not the padding
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
]
MODES = {
    "sync": ["async_training.mode=sync"],
    "one_step_off": ["async_training.mode=one_step_off"],
    "fully_async": ["async_training.mode=fully_async", "async_training.staleness_threshold=1"],
    "fully_async+partial": [
        "async_training.mode=fully_async",
        "async_training.staleness_threshold=1",
        "async_training.partial_rollout=true",
    ],
}
LENGTHS: dict[str, tuple[int, int]] = {}  # request id -> (drawn, generated) tokens; the agent loop (driver) fills it


def draw_length(request_id: str, median: int, cap: int) -> int:
    """The response length of one trajectory: deterministic in its request id (so the same in every mode)."""
    seed = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    if rng.random() < 1.0 / LONG_EVERY:
        return int(min(cap, rng.integers(TAIL_FACTOR * median * 9 // 10, TAIL_FACTOR * median * 11 // 10 + 1)))
    return int(min(cap, rng.integers(median // 2, median * 3 // 2 + 1)))


@register_agent_loop("long_tail_agent")
class LongTailAgentLoop(SingleTurnAgentLoop):
    """The single-turn loop with a per-trajectory ``max_new_tokens`` from ``draw_length``."""

    median = 12  # set by main() before the runs

    def max_new_tokens(self, row: dict[str, Any]) -> int:
        return draw_length(row["request_id"], self.median, self.response_length)

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        out = await super().run(sampling_params, **row)
        LENGTHS[row["request_id"]] = (self.max_new_tokens(row), len(out.response_ids))
        return out


def build_long_model(root: Path) -> str:
    """e2e_step's tiny random Qwen2 with EOS made very unlikely: hidden dimension 0 of every token embedding is
    set to 1 (it dominates the residual stream, so the final norm's output is large and positive there) and the
    EOS row's to -1; with tied embeddings the EOS logit is then ~20 below the others, so responses run to the
    length the agent loop asks for."""
    import torch
    from transformers import AutoModelForCausalLM

    from scaletrain.data.tokenizer import build_arithmetic_tokenizer

    path = build_model(root)
    eos = build_arithmetic_tokenizer().eos_token_id
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 1.0
        emb[eos, 0] = -1.0
    model.save_pretrained(path)
    return path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1 warm-up and 2 measured steps (default 2 and 8)")
    parser.add_argument("--rollout", default="vllm")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 8, quick 2)")
    parser.add_argument("--partial", action="store_true", help="also fully_async with partial_rollout=true")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="trainer config overrides (every run)")
    args = parser.parse_args()
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must be key=value, got {bad}")
    return args


def run_mode(root: Path, base: dict, mode: str, overrides: list[str]) -> tuple[list[dict], dict[int, list[int]]]:
    """One run: its metrics.jsonl rows and the recorded response lengths by step."""
    from scaletrain.trainer.main_ppo import run_ppo

    run_dir = root / mode.replace("+", "_")
    config = with_overrides(base, [*SPLIT, *MODES[mode], f"trainer.default_local_dir={run_dir}", *overrides])
    LENGTHS.clear()
    start = time.perf_counter()
    run_ppo(config)  # on a private Ray cluster of its own, shut down at its end
    short = sum(got < drawn for drawn, got in LENGTHS.values())
    print(
        f"[async_step] {mode}: run took {time.perf_counter() - start:.1f} s; {short} of {len(LENGTHS)} responses "
        "ended (EOS) before their drawn length",
        flush=True,
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    by_step: dict[int, list[int]] = {}
    for request_id, (_, length) in LENGTHS.items():
        match = re.match(r"step(\d+)-", request_id)
        if match:
            by_step.setdefault(int(match.group(1)), []).append(length)
    return rows, by_step


def summarize(rows: list[dict], lengths: dict[int, list[int]], steps: range, samples: int) -> dict[str, float]:
    """The figures of one mode over the measured ``steps``."""
    measured = [r for r in rows if r["step"] in steps]
    if len(measured) != len(steps):
        raise RuntimeError(f"expected metrics of steps {list(steps)}, got {[r['step'] for r in measured]}")

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in measured)

    step_s = total("timing_s/step")
    if "async/trainer_idle_s" in measured[0]:
        trainer_idle = total("async/trainer_idle_s") + total("timing_s/sync_weights")
        rollout_idle = total("async/rollout_idle_s")
    else:  # sync: the trainer waits for generation, scoring and the push; the rollout rank for everything else
        trainer_idle = total("timing_s/gen") + total("timing_s/reward") + total("timing_s/sync_weights")
        rollout_idle = step_s - total("timing_s/gen")
    pushes = [r["perf/weight_push_gib_per_s"] for r in measured if "perf/weight_push_gib_per_s" in r]
    lens = [n for s in steps for n in lengths.get(s, [])]
    return {
        "samples_per_s": samples * len(measured) / step_s,
        "trainer_idle": trainer_idle / step_s,
        "rollout_idle": rollout_idle / step_s,
        "staleness": total("async/staleness_mean") / len(measured),
        "push_gib_s": float(np.mean(pushes)) if pushes else float("nan"),
        "step_s": step_s / len(measured),
        "gen_s": total("timing_s/gen") / len(measured),
        "train_s": (total("timing_s/old_log_prob") + total("timing_s/update_actor")) / len(measured),
        **length_stats(lens, len(measured)),
    }


def length_stats(lens: list[int], batches: int) -> dict[str, float]:
    """Median, p90 and max of the measured response lengths; the long ones (>= half the tail factor x the
    median) per batch."""
    if not lens:
        return {"len_median": float("nan"), "len_p90": float("nan"), "len_max": float("nan"), "long_per_batch": 0.0}
    arr = np.asarray(lens, dtype=np.float64)
    median = float(np.median(arr))
    return {
        "len_median": median,
        "len_p90": float(np.percentile(arr, 90)),
        "len_max": float(arr.max()),
        "long_per_batch": float((arr >= TAIL_FACTOR / 2 * median).sum()) / batches,
    }


def report(results: dict[str, dict[str, float]]) -> None:
    """The table (one line per mode, ratio to sync) and the BENCH_JSON rows."""
    base = results["sync"]["samples_per_s"]
    print(
        f"{'mode':<21}{'samples/s':>10}{'vs sync':>9}{'trainer idle':>14}{'rollout idle':>14}{'staleness':>11}"
        f"{'push GiB/s':>12}{'step s':>8}{'gen s':>7}{'train s':>9}{'len med/p90/max':>17}{'long/batch':>12}"
    )
    for mode, r in results.items():
        lengths = f"{r['len_median']:.0f}/{r['len_p90']:.0f}/{r['len_max']:.0f}"
        print(
            f"{mode:<21}{r['samples_per_s']:>10.2f}{r['samples_per_s'] / base:>8.2f}x{r['trainer_idle']:>14.1%}"
            f"{r['rollout_idle']:>14.1%}{r['staleness']:>11.2f}{r['push_gib_s']:>12.3f}{r['step_s']:>8.2f}"
            f"{r['gen_s']:>7.2f}{r['train_s']:>9.2f}{lengths:>17}{r['long_per_batch']:>12.1f}"
        )
    print(
        "trainer idle: the step's time waiting for rollouts and weight pushes; rollout idle (sync: outside "
        "generation); train s: old log-prob + actor update; len: measured response tokens; long/batch: responses "
        f">= {TAIL_FACTOR // 2}x the median"
    )
    rows = []
    for mode, r in results.items():
        rows.append((f"async {mode} samples/s", r["samples_per_s"], None if mode == "sync" else base, "sync", "1/s"))
        rows.append((f"async {mode} trainer idle share", r["trainer_idle"] * 100, None, "", "%"))
    emit_results(rows)


def main() -> None:
    args = parse_args()
    prompts, n, resp, median = 8, 8, 192, 16
    steps = args.steps or (2 if args.quick else 8)
    warmup = 1 if args.quick else 2
    LongTailAgentLoop.median = median
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("scaletrain").setLevel(logging.INFO)  # e.g. where the worker group's ranks run

    from scaletrain.data.embedded import write_arithmetic_task

    total_steps = warmup + steps + 1  # the last step has no next rollout to overlap: not measured
    measured = range(warmup + 1, warmup + steps + 1)
    modes = [m for m in MODES if args.partial or m != "fully_async+partial"]
    results: dict[str, dict[str, float]] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_long_model(root)
        data = write_arithmetic_task(root / "data", seed=0, n_train=prompts * total_steps, n_val=8, n_test=8)
        base = step_config(root, model, data["train"], (prompts, n, resp), args.rollout, total_steps)
        for mode in modes:
            rows, lengths = run_mode(root, base, mode, args.overrides)
            results[mode] = summarize(rows, lengths, measured, prompts * n)
    wall = time.perf_counter() - start
    print(
        f"\nasync training, 1 train rank + 1 rollout rank ({args.rollout}): {prompts} prompts x {n} samples, "
        f"response lengths drawn with median {median}, 1 in {LONG_EVERY} ~{TAIL_FACTOR}x (cap {resp}); steps "
        f"{measured.start}-{measured.stop - 1} of {total_steps} measured; all runs took {wall:.0f} s"
    )
    report(results)


if __name__ == "__main__":
    main()
