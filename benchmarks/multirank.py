"""Multi-rank engine benchmarks: the tiny model and batch the benchmarks train on, and a gloo launcher.

- ``save_tiny_qwen2(path, seed, **overrides)``: a random-init Qwen2 causal LM (the embedded default's config with
  the given overrides) written with ``save_pretrained`` (``save_tiny_model``: the same in another architecture);
  ``make_batch(rows, prompt, response)``: a seeded rollout batch in verl's layout (left-padded prompts,
  right-padded responses, advantages).
- ``LAYOUTS``: backend + world size + megatron settings of every multi-rank layout benchmarked.
- ``launch(spec, timeout_s)``: starts ``spec["world"]`` processes (gloo, 1 thread each) running
  ``python -m benchmarks.multirank SPEC``; every rank builds the engine, times ``train_step`` on its rows and/or
  ``export_weights`` (every bucket consumed), and rank 0 writes the slowest rank's medians (plus, for export, a
  memcpy of the same exported tensors timed on rank 0 and the raw collective floor: one all-gather of the same
  bytes over the world) to a JSON file that ``launch`` returns.

Rows per rank: FSDP and DeepSpeed (data parallel) take ``rows / world`` each; megatron ranks of one DP group (here
all ranks: TP/PP only) take every row. With PP > 1 the batch is cut into ``2 x PP`` micro-batches so the
1F1B schedule overlaps stages; otherwise one micro-batch per rank and step.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import median_ms
from scaletrain.protocol import DataProto
from scaletrain.utils.net import free_port, local_rank_env

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
PAD_ID = 0
FIRST_TOKEN = 4  # ids below are special tokens

# name -> (backend, world size, megatron settings)
LAYOUTS = {
    "fsdp dp2": ("fsdp", 2, {}),
    "deepspeed zero3 dp2": ("deepspeed", 2, {}),
    "megatron tp2": ("megatron", 2, {"tensor_model_parallel_size": 2}),
    "megatron pp2": ("megatron", 2, {"pipeline_model_parallel_size": 2}),
    "megatron tp2 x pp2": ("megatron", 4, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
}
QUICK_LAYOUTS = [name for name, (_, world, _) in LAYOUTS.items() if world == 2]


def save_tiny_qwen2(path: str, seed: int = 0, **overrides) -> str:
    """Write a random-init Qwen2ForCausalLM (float32, no tokenizer) to ``path``; returns ``path``."""
    return save_tiny_model(path, "qwen2", seed, **overrides)


def save_tiny_model(path: str, architecture: str, seed: int = 0, **overrides) -> str:
    """Write a random-init causal LM of the embedded default's config in ``architecture`` (scaletrain/models/
    tiny.py's ``ARCHITECTURES``) with ``overrides`` (float32, no tokenizer) to ``path``; returns ``path``."""
    from transformers import AutoModelForCausalLM

    from scaletrain.data.embedded import tiny_model_config

    settings = dict(vocab_size=128, max_position_embeddings=1024)
    settings.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = tiny_model_config(architecture, **settings)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def make_batch(rows: int, prompt: int, response: int, vocab_size: int = 128, seed: int = 0) -> DataProto:
    """Seeded batch: prompt lengths in [prompt/2, prompt] (left-padded), responses in [response/2, response]."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(max(1, prompt // 2), prompt + 1, (rows,), generator=g)
    resp_lens = torch.randint(max(1, response // 2), response + 1, (rows,), generator=g)
    prompt_mask = (torch.arange(prompt)[None, :] >= (prompt - prompt_lens)[:, None]).long()
    resp_mask = (torch.arange(response)[None, :] < resp_lens[:, None]).long()
    attention_mask = torch.cat([prompt_mask, resp_mask], dim=1)
    tokens = torch.randint(FIRST_TOKEN, vocab_size, (rows, prompt + response), generator=g)
    input_ids = torch.where(attention_mask.bool(), tokens, torch.full_like(tokens, PAD_ID))
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, prompt:].clone(),
            "response_mask": resp_mask,
            "advantages": torch.randn(rows, response, generator=g) * resp_mask,
            "old_log_probs": torch.zeros(rows, response),
        },
        meta_info={"temperature": 1.0},
    )


def loss_fn(out, mb):
    """Per-row-mean policy-gradient loss on response log-probs (the same in every variant)."""
    m = mb.batch["response_mask"].float()
    return -((out["log_probs"] * mb.batch["advantages"] * m).sum(-1) / m.sum(-1)).mean(), {}


def rank_share(backend: str, settings: dict, rows: int, rank: int, world: int) -> tuple[slice, int]:
    """(this rank's rows, micro-batch size) for a layout."""
    if backend in ("fsdp", "deepspeed"):
        share = rows // world
        return slice(rank * share, (rank + 1) * share), share
    pp = settings.get("pipeline_model_parallel_size", 1)
    return slice(0, rows), max(1, rows // (2 * pp)) if pp > 1 else rows


def build_engine(backend: str, model_dir: str, settings: dict, micro: int):
    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig, OptimConfig

    extra = {"megatron": dict(settings)} if backend == "megatron" else {}
    return get_backend(backend)(
        ModelConfig(path=model_dir), OptimConfig(lr=1e-5), EngineConfig(micro_batch_size_per_gpu=micro, extra=extra)
    )


def export_all(engine, bucket_bytes: int, keep: bool = False):
    """Consume every exported bucket; returns (bytes, number of buckets, clones of the tensors if ``keep``)."""
    total, count, kept = 0, 0, []
    for bucket in engine.export_weights(bucket_bytes):
        count += 1
        for _, t in bucket:
            total += t.numel() * t.element_size()
            if keep:
                kept.append(t.detach().clone())
    return total, count, kept


def gather_floor_ms(nbytes: int, world: int, repeats: int) -> float:
    """The raw collective floor of an export of ``nbytes``: one all-gather of ``nbytes / world`` bytes per rank
    into ``nbytes`` on every rank, in the world's process group (what any layout's export must at least move)."""
    import torch.distributed as dist

    share = torch.empty(-(-nbytes // world), dtype=torch.uint8)
    full = torch.empty(share.numel() * world, dtype=torch.uint8)
    return median_ms(lambda: dist.all_gather_into_tensor(full, share), repeats=repeats, warmup=1)


def run_rank(spec_file: str) -> None:
    """One rank: time what ``spec["measure"]`` names; rank 0 writes ``spec["out"]``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_file).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend, settings, repeats = spec["backend"], spec["settings"], spec["repeats"]
    rows, micro = rank_share(backend, settings, spec.get("rows", 8), rank, world)
    engine = build_engine(backend, spec["model_dir"], settings, micro)
    result = {}
    if "train" in spec["measure"]:
        data = make_batch(spec["rows"], spec["prompt"], spec["response"], spec["vocab_size"])[rows]
        result["train_ms"] = median_ms(lambda: engine.train_step(data, loss_fn), repeats=repeats, warmup=2)
    if "export" in spec["measure"]:
        bucket_bytes = int(spec["bucket_mib"] * 2**20)
        result["export_ms"] = median_ms(lambda: export_all(engine, bucket_bytes), repeats=repeats, warmup=1)
        nbytes, buckets, kept = export_all(engine, bucket_bytes, keep=rank == 0)
        result.update(export_bytes=nbytes, buckets=buckets)
        result["gather_floor_ms"] = gather_floor_ms(nbytes, world, repeats)
    keys = ("train_ms", "export_ms", "gather_floor_ms")
    t = torch.tensor([result.get(k, 0.0) for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step takes as long as its slowest rank
    result.update(zip(keys, t.tolist()))
    if rank == 0 and "export" in spec["measure"]:
        targets = [torch.empty_like(x) for x in kept]

        def copy_all() -> None:
            for src, dst in zip(kept, targets):
                dst.copy_(src)

        result["memcpy_ms"] = median_ms(copy_all, repeats=repeats)
    dist.barrier()
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(result))
    dist.destroy_process_group()


def rank_or_main(run_rank, main) -> None:
    """A multi-rank benchmark script's entry: run as one of ``launch``'s ranks (``python -m module SPEC.json``)
    it runs ``run_rank(SPEC.json)``, otherwise ``main()``."""
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        run_rank(sys.argv[1])
    else:
        main()


def launch(spec: dict, timeout_s: float = 900.0, module: str = "benchmarks.multirank") -> dict:
    """Run ``spec`` on ``spec["world"]`` gloo ranks (fresh processes of ``python -m module SPEC_FILE``, whose rank 0
    writes ``spec["out"]``); returns rank 0's results."""
    work = Path(tempfile.mkdtemp(prefix="bench_ranks_"))
    spec = {**spec, "out": str(work / "result.json")}
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec))
    port, world = free_port(), spec["world"]
    procs, logs = [], []
    for rank in range(world):
        env = local_rank_env(rank, world, port, str(ROOT))
        log = open(work / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, str(spec_file)],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    out = Path(spec["out"])
    if not out.exists() or any(p.returncode for p in procs):
        tail = (work / "rank0.log").read_text()[-3000:]
        raise RuntimeError(
            f"{module} {spec.get('backend', '')} on {world} ranks failed (logs in {work}); rank 0 log:\n{tail}"
        )
    result = json.loads(out.read_text())
    shutil.rmtree(work, ignore_errors=True)
    return result


def layout_spec(name: str, model_dir: str, measure: tuple[str, ...], repeats: int, **extra) -> dict:
    backend, world, settings = LAYOUTS[name]
    return {
        "backend": backend,
        "world": world,
        "settings": settings,
        "model_dir": model_dir,
        "measure": list(measure),
        "repeats": repeats,
        **extra,
    }


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    run_rank(sys.argv[1])
