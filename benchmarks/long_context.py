"""How a training step's cost grows with the response length, without and with Ulysses sequence parallelism.

    python benchmarks/long_context.py            # 512 to 16k response tokens, SP=1 (1 rank) and SP=2 (2 ranks)
    python benchmarks/long_context.py --quick    # 512 to 2k

One fsdp ``train_step`` (log-probs + entropy, packed, fp32, 1 thread per rank) of one row of 64 prompt + N response
tokens on a tiny Qwen2 (hidden 64, 2 layers, 4 heads, 128-token vocabulary, so attention and activations dominate,
not the LM head). SP=1 runs on one rank; SP=2 on two ranks, each holding half of the sequence
(backends/sequence/ulysses.py). Per length, after one untimed step: the time is the slowest rank's median of
``--repeats`` steps, the peak the largest rank's resident-set growth during them (the kernel's peak, VmHWM, reset
first, less the size before). Then a least-squares fit
``time = a + b N + c N^2`` per SP size, printed as the linear and quadratic parts at the longest length.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT = 64
LENGTHS = {"quick": [512, 1024, 2048], "full": [512, 1024, 2048, 4096, 8192, 16384]}


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field in KiB (VmRSS: now; VmHWM: the peak since the last reset)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident set (Linux >= 4.0)
        f.write("5")


def run_rank(spec_file: str) -> None:
    """One rank: an fsdp engine with the spec's SP size, one step per length; rank 0 writes the results."""
    import torch
    import torch.distributed as dist

    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig, OptimConfig
    from benchmarks.common import median_ms
    from tests.backends.reference import actor_loss
    from tests.backends.tiny import make_batch

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_file).read_text())
    engine = get_backend("fsdp")(
        ModelConfig(path=spec["model_dir"], use_remove_padding=True),
        OptimConfig(lr=1e-5),
        EngineConfig(micro_batch_size_per_gpu=1, ulysses_sequence_parallel_size=spec["world"]),
    )
    results = []
    for n in spec["lengths"]:
        data = make_batch(1, PROMPT, n, vocab_size=128, min_prompt=PROMPT, min_response=n)

        step = partial(engine.train_step, data, actor_loss, ("log_probs", "entropy"))
        step()  # the first step at a length allocates what later ones reuse
        _reset_peak()
        before = _status_kib("VmRSS")
        ms = median_ms(step, repeats=spec["repeats"], warmup=0)
        peak_mib = (_status_kib("VmHWM") - before) / 1024
        worst = torch.tensor([peak_mib, ms], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        results.append({"tokens": n, "peak_mib": worst[0].item(), "ms": worst[1].item()})
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    dist.barrier()


def fit(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares (a, b, c) of y = a + b x + c x^2 (x in tokens)."""
    import numpy as np

    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    a, b, c = np.linalg.lstsq(np.stack([np.ones_like(x), x, x * x], axis=1), y, rcond=None)[0]
    return float(a), float(b), float(c)


def main() -> None:
    from benchmarks.common import emit_results
    from benchmarks.multirank import launch, save_tiny_qwen2

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    lengths = LENGTHS["quick" if args.quick else "full"]
    by_sp = {}
    with tempfile.TemporaryDirectory() as work:
        model_dir = save_tiny_qwen2(os.path.join(work, "model"), max_position_embeddings=PROMPT + lengths[-1])
        for sp in (1, 2):
            spec = {"world": sp, "model_dir": model_dir, "lengths": lengths, "repeats": args.repeats}
            by_sp[sp] = launch(spec, timeout_s=3600, module="benchmarks.long_context")
    print(f"\n{'response tokens':>16}{'SP=1 ms':>11}{'SP=1 MiB':>10}{'SP=2 ms':>11}{'SP=2 MiB':>10}")
    rows = []
    for one, two in zip(by_sp[1], by_sp[2], strict=True):
        n = one["tokens"]
        print(f"{n:>16}{one['ms']:>11.0f}{one['peak_mib']:>10.0f}{two['ms']:>11.0f}{two['peak_mib']:>10.0f}")
        rows.append((f"step ms, {n} tokens, SP=2 (2 ranks) vs SP=1", two["ms"], one["ms"], "SP=1 (1 rank)", "ms"))
        rows.append(
            (f"peak MiB per rank, {n} tokens, SP=2 vs SP=1", two["peak_mib"], one["peak_mib"], "SP=1 (1 rank)", "MiB")
        )
    longest = lengths[-1]
    for sp, results in by_sp.items():
        a, b, c = fit([(r["tokens"], r["ms"]) for r in results])
        print(
            f"SP={sp}: time ~ {a:.0f} + {b:.4f} N + {c:.3e} N^2 ms; at {longest} tokens the linear part is "
            f"{b * longest:.0f} ms, the quadratic {c * longest**2:.0f} ms"
        )
    emit_results(rows)


if __name__ == "__main__":
    from benchmarks.multirank import rank_or_main

    rank_or_main(run_rank, main)
