"""Training throughput of every engine and layout against a plain single-process torch training loop.

    python benchmarks/train_throughput.py            # hidden 256, 4 layers, 32 rows x (128 + 128) tokens
    python benchmarks/train_throughput.py --quick    # hidden 64, 2 layers, 16 rows x (32 + 32), 2-rank layouts only

Same model, batch, loss (a per-row-mean policy-gradient loss on response log-probs) and AdamW in every
variant. Rows measured (median ms per optimizer step, and valid tokens per second), all in one run:
  - plain loop, 1 and 2 threads: HF forward + chunked log-probs + backward + clip + AdamW step, no framework;
  - FSDP engine, 1 process (world size 1), padded and remove-padding, one micro-batch per step;
  - multi-rank layouts (benchmarks/multirank.py; gloo, 1 thread per rank): FSDP DP=2, DeepSpeed ZeRO-3 DP=2,
    megatron TP=2 and PP=2, and (full size only) megatron TP=2 x PP=2 on 4 ranks; each against the plain loop at
    1 thread and at 2 threads (the same two cores).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import emit_results, median_ms, print_table  # noqa: E402
from benchmarks.multirank import (  # noqa: E402
    LAYOUTS,
    QUICK_LAYOUTS,
    launch,
    layout_spec,
    loss_fn,
    make_batch,
    save_tiny_qwen2,  # noqa: E402
)

SIZES = {
    "quick": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, rows=16, prompt=32, response=32),
    "full": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, rows=32, prompt=128, response=128),
}
VOCAB = 128


def make_data(size: dict, seed: int = 0):
    return make_batch(size["rows"], size["prompt"], size["response"], vocab_size=VOCAB, seed=seed)


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
        logits = model(
            input_ids=b["input_ids"],
            attention_mask=b["attention_mask"],
            position_ids=b["position_ids"],
            use_cache=False,
            logits_to_keep=R + 1,
        ).logits[:, :-1]
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
    engine = get_backend("fsdp")(
        ModelConfig(path=model_dir, use_remove_padding=remove_padding),
        OptimConfig(lr=1e-5),
        EngineConfig(micro_batch_size_per_gpu=len(data)),
    )
    return median_ms(lambda: engine.train_step(data, loss_fn), repeats=repeats, warmup=2)


def multirank_ms(name: str, model_dir: str, size: dict, repeats: int) -> float:
    spec = layout_spec(
        name,
        model_dir,
        ("train",),
        repeats,
        rows=size["rows"],
        prompt=size["prompt"],
        response=size["response"],
        vocab_size=VOCAB,
    )
    return launch(spec)["train_ms"]


def label(name: str) -> str:
    backend, world, _ = LAYOUTS[name]
    return "fsdp 2 ranks x 1 thread" if name == "fsdp dp2" else f"{name}, {world} ranks x 1 thread"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--only", nargs="*", default=None, help=f"layouts among {list(LAYOUTS)}")
    args = parser.parse_args()

    size_name = "quick" if args.quick else "full"
    size = SIZES[size_name]
    repeats = args.repeats or (5 if args.quick else 7)
    layouts = args.only if args.only is not None else (QUICK_LAYOUTS if args.quick else list(LAYOUTS))
    model_dir = save_tiny_qwen2(
        tempfile.mkdtemp(prefix="train_bench_"),
        seed=0,
        vocab_size=VOCAB,
        **{k: size[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")},
    )
    tokens = int(make_data(size).batch["attention_mask"].sum())

    plain1 = plain_loop_ms(model_dir, size, 1, repeats)
    plain2 = plain_loop_ms(model_dir, size, 2, repeats)
    fsdp1 = engine_ms(model_dir, size, repeats, remove_padding=False)
    fsdp1_rmpad = engine_ms(model_dir, size, repeats, remove_padding=True)
    multi = {}
    for name in layouts:
        try:
            multi[name] = multirank_ms(name, model_dir, size, repeats)
        except Exception as exc:  # one layout failing must not hide the others' numbers
            print(f"\n{name}: FAILED: {exc}", flush=True)

    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    print(
        f"\nmodel: Qwen2 hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}; "
        f"batch {size['rows']} rows x ({size['prompt']} + {size['response']}), {tokens} valid tokens/step"
    )
    table = [
        ("fsdp 1 proc, padded", fsdp1, plain1, "plain loop 1 thread"),
        ("fsdp 1 proc, remove-padding", fsdp1_rmpad, plain1, "plain loop 1 thread"),
    ]
    for name, ms in multi.items():
        table += [
            (label(name), ms, plain2, "plain loop 2 threads"),
            (label(name) + " ", ms, plain1, "plain loop 1 thread"),
        ]
    print_table("train step (median ms; ratio = ours / baseline, lower is better)", table)
    rates = [
        ("plain loop 1 thread", plain1),
        ("plain loop 2 threads", plain2),
        ("fsdp 1 proc, padded", fsdp1),
        ("fsdp 1 proc, remove-padding", fsdp1_rmpad),
    ] + [(label(n), ms) for n, ms in multi.items()]
    print(f"\n{'tokens/s':<44}{'tok/s':>10}{'vs plain 1t':>13}{'vs plain 2t':>13}")
    for name, ms in rates:
        print(f"{name:<44}{tokens / ms * 1e3:>10,.0f}{plain1 / ms:>12.2f}x{plain2 / ms:>12.2f}x")
    emit_results([(f"train {n.strip()} vs {b}", o, p, b) for n, o, p, b in table])
    shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
