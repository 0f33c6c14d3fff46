"""Rollout throughput: our engines against the library calls they wrap, on the same batch and settings.

    python benchmarks/rollout_throughput.py [--quick]

- vllm: ``VLLMRolloutEngine.generate`` (DataProto in, DataProto out) vs raw ``vllm.LLM.generate`` on the same
  token prompts and SamplingParams (n samples, temperature 1, seeds, sampled-token log-probs).
- hf: ``HFRolloutEngine.generate`` vs raw ``model.generate`` with the same GenerationConfig (scores included).
The ratio is our wrapper's overhead (prompt unpadding, output layout, log-prob gathering). Tokens/s counts the
response tokens actually generated (up to and including EOS). One torch thread for every row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from backends.rollout.base import RolloutConfig, SamplingConfig  # noqa: E402
from benchmarks.common import emit_results, print_table  # noqa: E402
from scaletrain.protocol import DataProto  # noqa: E402
from tests.backends.tiny import make_tokenizer, save_tiny_qwen2  # noqa: E402

MODEL = dict(hidden_size=128, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def make_prompts(tokenizer, count: int) -> DataProto:
    g = torch.Generator().manual_seed(0)
    texts = [
        "".join(chr(int(c)) for c in torch.randint(97, 123, (int(k),), generator=g))
        for k in torch.randint(4, 24, (count,), generator=g)
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def paired_median_ms(ours, raw, repeats: int) -> tuple[float, float]:
    """Median ms of each function, timed alternately (after one warm-up each) so machine load hits both alike."""
    times: dict[int, list[float]] = {0: [], 1: []}
    ours(), raw()
    for _ in range(repeats):
        for i, fn in enumerate((ours, raw)):
            start = time.perf_counter()
            fn()
            times[i].append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 prompts x 2 samples x 32 tokens, 5 repeats")
    args = parser.parse_args()
    prompts_n, n, max_new, reps = (32, 2, 32, 5) if args.quick else (64, 4, 64, 7)
    torch.set_num_threads(1)
    model_dir = save_tiny_qwen2(tempfile.mkdtemp(prefix="bench-rollout-"), **MODEL)
    tokenizer = make_tokenizer()
    tokenizer.padding_side = "left"
    prompts = make_prompts(tokenizer, prompts_n)
    sampling = SamplingConfig(n=n, temperature=1.0, max_new_tokens=max_new, seed=0)
    config = RolloutConfig(model_path=model_dir, max_model_len=256, kv_cache_bytes=64 << 20)
    rows, tokens = [], {}

    from backends.rollout.vllm_engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(config, tokenizer)
    requests, params = engine.requests(prompts, sampling)
    out = engine.generate(prompts, sampling)
    tokens["vllm"] = int(out.batch["response_mask"].sum())
    ours, raw = paired_median_ms(
        lambda: engine.generate(prompts, sampling), lambda: engine.llm.generate(requests, params, use_tqdm=False), reps
    )
    rows.append(("vllm generate", ours, raw, "vllm.LLM.generate"))
    rates = [("vllm", ours, raw)]
    torch.set_num_threads(1)

    from backends.rollout.hf import HFRolloutEngine

    hf = HFRolloutEngine(config, tokenizer)
    gen_config = hf._generation_config(sampling)
    ids = prompts.batch["input_ids"].repeat_interleave(n, dim=0)
    mask = prompts.batch["attention_mask"].repeat_interleave(n, dim=0)
    out = hf.generate(prompts, sampling)
    tokens["hf"] = int(out.batch["response_mask"].sum())

    def raw_hf():
        torch.manual_seed(0)
        with torch.no_grad():
            hf.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)

    ours_hf, raw_hf_ms = paired_median_ms(lambda: hf.generate(prompts, sampling), raw_hf, reps)
    rows.append(("hf generate", ours_hf, raw_hf_ms, "model.generate"))
    rates.append(("hf", ours_hf, raw_hf_ms))

    print(f"\n{prompts_n} prompts x n={n} x {max_new} new tokens, tiny Qwen2 {MODEL}, 1 thread")
    print_table(f"rollout generate (median of {reps}, alternating ours / raw)", rows)
    print(f"\n{'engine':<8}{'tokens':>8}{'ours tok/s':>12}{'raw tok/s':>12}")
    for name, ours_ms, raw_ms in rates:
        print(f"{name:<8}{tokens[name]:>8}{tokens[name] / ours_ms * 1e3:>12.0f}{tokens[name] / raw_ms * 1e3:>12.0f}")
    emit_results(rows)


if __name__ == "__main__":
    main()
