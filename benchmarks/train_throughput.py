"""Training throughput of the FSDP2 engine against a plain single-process torch training loop.

    python benchmarks/train_throughput.py            # hidden 256, 4 layers, 32 rows x (128 + 128) tokens
    python benchmarks/train_throughput.py --quick    # hidden 64, 2 layers, 16 rows x (32 + 32) tokens

Same model, batch, loss (a per-row-mean policy-gradient loss on response log-probs) and AdamW in every
variant. Rows measured (median ms per optimizer step, and valid tokens per second):
  - plain loop, 1 thread: HF forward + chunked log-probs + backward + clip + AdamW step, no framework;
  - FSDP engine, 1 process (world size 1), padded and remove-padding, one micro-batch per step;
  - FSDP engine, 2 processes (gloo, 1 thread each, half the rows each), against the plain loop at 2 threads
    (the same two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import emit_results, median_ms, print_table  # noqa: E402

SIZES = {
    "quick": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, rows=16, prompt=32, response=32),
    "full": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, rows=32, prompt=128, response=128),
}


def loss_fn(out, mb):
    m = mb.batch["response_mask"].float()
    return -((out["log_probs"] * mb.batch["advantages"] * m).sum(-1) / m.sum(-1)).mean(), {}


def make_data(size: dict, seed: int = 0):
    from tests.backends.tiny import make_batch

    return make_batch(size["rows"], size["prompt"], size["response"], seed=seed, min_prompt=size["prompt"] // 2,
                      min_response=size["response"] // 2)


def plain_loop_ms(model_dir: str, size: dict, threads: int, repeats: int) -> float:
    from transformers import AutoModelForCausalLM

    from scaletrain.algos import logprobs_from_logits

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    data = make_data(size)
    b = data.batch
    R = b["responses"].shape[1]

    def step():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"], use_cache=False, logits_to_keep=R + 1).logits[:, :-1]
        loss, _ = loss_fn({"log_probs": logprobs_from_logits(logits, b["responses"])}, data)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    ms = median_ms(step, repeats=repeats, warmup=2)
    torch.set_num_threads(1)
    return ms


def engine_ms(model_dir: str, size: dict, repeats: int, remove_padding: bool, rows: slice | None = None) -> float:
    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig, OptimConfig

    data = make_data(size)
    if rows is not None:
        data = data[rows]
    engine = get_backend("fsdp")(ModelConfig(path=model_dir, use_remove_padding=remove_padding),
                                 OptimConfig(lr=1e-5), EngineConfig(micro_batch_size_per_gpu=len(data)))
    return median_ms(lambda: engine.train_step(data, loss_fn), repeats=repeats, warmup=2)


def worker(model_dir: str, size_name: str, repeats: int, out_file: str) -> None:
    """One rank of the 2-process run: half the rows each."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    size = SIZES[size_name]
    share = size["rows"] // world
    ms = engine_ms(model_dir, size, repeats, remove_padding=False, rows=slice(rank * share, (rank + 1) * share))
    t = torch.tensor([ms])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"ms": float(t)}, f)
    dist.destroy_process_group()


def two_rank_ms(model_dir: str, size_name: str, repeats: int) -> float:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_file = os.path.join(model_dir, "two_rank.json")
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", model_dir, "--size", size_name,
               "--repeats", str(repeats), "--out", out_file]
        procs.append(subprocess.Popen(cmd, env=env))
    try:
        for p in procs:
            if p.wait(timeout=900) != 0:
                raise RuntimeError("a 2-rank benchmark worker failed")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    with open(out_file) as f:
        return json.load(f)["ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", default="quick", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.size, args.repeats, args.out)
        return

    from tests.backends.tiny import save_tiny_qwen2

    size_name = "quick" if args.quick else "full"
    size = SIZES[size_name]
    repeats = args.repeats or (5 if args.quick else 7)
    model_dir = save_tiny_qwen2(tempfile.mkdtemp(prefix="train_bench_"), seed=0, with_tokenizer=False,
                                **{k: size[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")})
    tokens = int(make_data(size).batch["attention_mask"].sum())

    plain1 = plain_loop_ms(model_dir, size, 1, repeats)
    plain2 = plain_loop_ms(model_dir, size, 2, repeats)
    fsdp1 = engine_ms(model_dir, size, repeats, remove_padding=False)
    fsdp1_rmpad = engine_ms(model_dir, size, repeats, remove_padding=True)
    fsdp2 = two_rank_ms(model_dir, size_name, repeats)

    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    print(f"\nmodel: Qwen2 hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}; "
          f"batch {size['rows']} rows x ({size['prompt']} + {size['response']}), {tokens} valid tokens/step")
    table = [
        ("fsdp 1 proc, padded", fsdp1, plain1, "plain loop 1 thread"),
        ("fsdp 1 proc, remove-padding", fsdp1_rmpad, plain1, "plain loop 1 thread"),
        ("fsdp 2 ranks x 1 thread", fsdp2, plain2, "plain loop 2 threads"),
        ("fsdp 2 ranks x 1 thread ", fsdp2, plain1, "plain loop 1 thread"),
    ]
    print_table("train step (median ms; ratio = ours / baseline, lower is better)", table)
    print("\ntokens/s: " + ", ".join(f"{name} {tokens / ms * 1e3:,.0f}" for name, ms in (
        ("plain-1t", plain1), ("plain-2t", plain2), ("fsdp-1p", fsdp1), ("fsdp-1p-rmpad", fsdp1_rmpad),
        ("fsdp-2r", fsdp2))))
    emit_results([(f"train {n.strip()} vs {b}", o, p, b) for n, o, p, b in table])


if __name__ == "__main__":
    main()
