"""Weight sync: each engine's ``export_weights`` and the rollout engines' ``update_weights``, against memcpy.

    python benchmarks/weight_sync.py [--quick]     # --quick: 2-rank layouts only

The buckets are what a training engine's ``export_weights`` hands over: HF-named full tensors of the trained
model's state_dict, grouped into buckets of at most ``--bucket-mib``. Measured per engine:
- vllm: ``VLLMRolloutEngine.update_weights`` (in-process: vLLM's ``reload_weights`` re-fusing q/k/v and gate/up,
  re-packing for the CPU kernels, then a prefix-cache reset),
- hf: ``HFRolloutEngine.update_weights`` (``load_state_dict(strict=False)`` per bucket),
- vllm async: the agent loops' AsyncLLM, whose model runs in an engine-core process: through two reused
  shared-memory slots (``checkpoint_engine.backend=shm``, ipc_transport.py) and through one safetensors file per
  bucket in /dev/shm (``naive``); the most bytes the slots held is printed beside the whole model's,
against the floor: ``copy_`` of every tensor into preallocated tensors of the same shapes (one memcpy).

Export side, per training backend and layout (benchmarks/multirank.py; gloo ranks, 1 thread each): the time to
consume every bucket of ``export_weights(bucket_bytes)`` (full HF tensors: FSDP all-gathers DTensor shards,
DeepSpeed ZeRO-3 gathers partitioned parameters, megatron all-gathers each local layer index's TP shards of
every PP stage at once), slowest rank, against a memcpy of the same exported tensors timed in the same run on
rank 0, and against the raw collective floor (one all-gather of the same bytes over the same ranks; target <=
1.5x). Layouts: FSDP DP=2, DeepSpeed ZeRO-3 DP=2, megatron TP=2 and PP=2, and (full only) megatron TP=2 x PP=2
on 4 ranks, and a Qwen3-MoE model of the same dense shape (8 experts) on megatron EP=2 and PP=2 x EP=2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from backends.rollout.base import RolloutConfig  # noqa: E402
from benchmarks.common import emit_results, median_ms, print_table  # noqa: E402
from benchmarks.multirank import (  # noqa: E402
    LAYOUTS,
    QUICK_LAYOUTS,
    launch,
    layout_spec,
    save_tiny_model,
    save_tiny_qwen2,
)

QUICK = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=4096,
)
FULL = dict(
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=16384,
)


# a Qwen3-MoE model of FULL's dense shape, 8 experts of a quarter of the MLP's width in every layer, 2 per token
MOE_SHAPE = dict(FULL, head_dim=64, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2)
MOE_LAYOUTS = {  # name -> (world, megatron settings): the experts split over EP ranks (the dense layers' DP)
    "megatron ep2 moe": (2, {"expert_model_parallel_size": 2}),
    "megatron pp2 x ep2 moe": (4, {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}),
}


def export_buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs in state_dict order into buckets of at most ``bucket_bytes``."""
    buckets, current, size = [], [], 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    return buckets + ([current] if current else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="~9M-parameter model, 5 repeats")
    parser.add_argument("--bucket-mib", type=float, default=8.0)
    parser.add_argument("--only", nargs="*", default=None, help=f"export layouts among {[*LAYOUTS, *MOE_LAYOUTS]}")
    args = parser.parse_args()
    shape, reps = (QUICK, 5) if args.quick else (FULL, 7)
    torch.set_num_threads(1)
    model_dir = save_tiny_qwen2(tempfile.mkdtemp(prefix="bench-sync-"), **shape)
    from scaletrain.data.tokenizer import build_arithmetic_tokenizer

    tokenizer = build_arithmetic_tokenizer()
    config = RolloutConfig(model_path=model_dir, max_model_len=256, kv_cache_bytes=32 << 20)

    from backends.rollout.hf import HFRolloutEngine

    trainer = HFRolloutEngine(config, tokenizer)  # its model stands in for the trained policy
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    state = trainer.model.state_dict()
    buckets = export_buckets(state, int(args.bucket_mib * 2**20))
    # tied embeddings appear twice in a state_dict (embed_tokens and lm_head): both are sent, both count
    total = sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)
    targets = [[torch.empty_like(t) for _, t in bucket] for bucket in buckets]

    def copy_all() -> None:
        for bucket, dst in zip(buckets, targets):
            for (_, src), out in zip(bucket, dst):
                out.copy_(src)

    copy_ms = median_ms(copy_all, reps)

    from backends.rollout.vllm_engine import VLLMRolloutEngine

    vllm_engine = VLLMRolloutEngine(config, tokenizer)
    torch.set_num_threads(1)
    vllm_ms = median_ms(lambda: vllm_engine.update_weights(buckets), reps)
    hf = HFRolloutEngine(config, tokenizer)
    hf_ms = median_ms(lambda: hf.update_weights(buckets), reps)
    process_rows, slot_peak = engine_process_rows(config, tokenizer, buckets, reps, copy_ms)

    params = sum(p.numel() for p in trainer.model.parameters())
    print(
        f"\n{params / 1e6:.1f}M params, {total / 2**20:.1f} MiB sent in {len(buckets)} buckets "
        f"of <= {args.bucket_mib:g} MiB, 1 thread"
    )
    table = [
        ("in-memory copy of the same bytes", copy_ms, None, ""),
        ("vllm update_weights", vllm_ms, copy_ms, "memcpy"),
        ("hf update_weights", hf_ms, copy_ms, "memcpy"),
    ]
    table += process_rows
    print_table(f"update_weights (median of {reps})", table)
    print(
        f"engine in another process: /dev/shm held at most {slot_peak / 2**20:.1f} MiB with shm (two slots), "
        f"{total / 2**20:.1f} MiB (the whole model) with naive"
    )
    for name, ms in [("memcpy", copy_ms), ("vllm", vllm_ms), ("hf", hf_ms)]:
        print(f"{name:<8}{total / 2**30 / (ms / 1e3):>8.2f} GiB/s")
    layouts = args.only if args.only is not None else (QUICK_LAYOUTS if args.quick else [*LAYOUTS, *MOE_LAYOUTS])
    specs = [(name, layout_spec(name, model_dir, ("export",), reps)) for name in layouts if name in LAYOUTS]
    if any(name in MOE_LAYOUTS for name in layouts):
        moe_dir = save_tiny_model(os.path.join(model_dir, "moe"), "qwen3_moe", **MOE_SHAPE)
        for name in (n for n in layouts if n in MOE_LAYOUTS):
            world, settings = MOE_LAYOUTS[name]
            spec = {"backend": "megatron", "world": world, "settings": settings, "model_dir": moe_dir}
            specs.append((name, dict(spec, measure=["export"], repeats=reps)))
    exports = export_rows(specs, reps, args.bucket_mib)
    emit_results([(f"weight sync {r[0]}", *r[1:]) for r in table + exports])
    shutil.rmtree(model_dir, ignore_errors=True)


def engine_process_rows(config, tokenizer, buckets, reps: int, copy_ms: float) -> tuple[list[tuple], int]:
    """The agent loops' AsyncLLM (its model in an engine-core process): ``update_weights`` through the two reused
    shared-memory slots (shm) and through one file per bucket in /dev/shm (naive), against memcpy; and the most
    bytes the slots held."""
    from dataclasses import replace

    from backends.rollout.base import CheckpointEngineSettings
    from backends.rollout.vllm_async import VLLMAsyncRolloutEngine

    engine = VLLMAsyncRolloutEngine(config, tokenizer)
    rows = []
    try:
        for backend in ("shm", "naive"):
            engine.config = replace(config, checkpoint_engine=CheckpointEngineSettings(backend=backend))
            ms = median_ms(lambda: engine.update_weights(buckets), reps)
            rows.append((f"vllm async (engine process) update_weights, {backend}", ms, copy_ms, "memcpy"))
        peak = engine.slots.peak_bytes if engine.slots is not None else 0
    finally:
        engine.close()
    return rows, peak


def export_rows(specs: list[tuple[str, dict]], reps: int, bucket_mib: float) -> list[tuple]:
    """``export_weights`` per (layout name, launch spec) vs memcpy of the same bytes, both measured in that
    layout's launch, and vs the collective floor."""
    table, sizes = [], []
    for name, spec in specs:
        try:
            res = launch(dict(spec, bucket_mib=bucket_mib))
        except Exception as exc:  # one layout failing must not hide the others' numbers
            print(f"\n{name}: FAILED: {exc}", flush=True)
            continue
        world = spec["world"]
        table.append((f"{name} ({world} ranks) export_weights", res["export_ms"], res["memcpy_ms"], "memcpy"))
        floor = res["gather_floor_ms"]
        table.append((f"{name} ({world} ranks) export vs collective floor", res["export_ms"], floor, "all-gather"))
        sizes.append((name, res["export_bytes"], res["buckets"], res["export_ms"], res["memcpy_ms"]))
    print_table(f"export_weights, full HF tensors in buckets of <= {bucket_mib:g} MiB (median of {reps})", table)
    for name, nbytes, buckets, ms, copy_ms in sizes:
        print(
            f"{name:<22}{nbytes / 2**20:>8.1f} MiB in {buckets:>3} buckets  export "
            f"{nbytes / 2**30 / (ms / 1e3):>6.2f} GiB/s  memcpy {nbytes / 2**30 / (copy_ms / 1e3):>6.2f} GiB/s"
        )
    return table


if __name__ == "__main__":
    main()
