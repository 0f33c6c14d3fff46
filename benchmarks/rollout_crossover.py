"""vLLM against transformers' ``generate`` as the model grows: where vLLM (CPU) starts to generate faster.

    python benchmarks/rollout_crossover.py [--quick]

For each model, our two rollout engines (backends/rollout/vllm_engine.py, backends/rollout/hf.py: at the speed of the
library calls they wrap, benchmarks/rollout_throughput.py) generate the same prompts, 1 torch thread, sampled at
temperature 1 with a seed, every response running to the length limit (``ignore_eos``: no EOS in the character
vocabulary of the synthetic models; SmolLM2 stops where it stops and both count the tokens they generated). Random-init
Qwen2 models of growing width and depth with a 99-token vocabulary, then SmolLM2-135M-Instruct (49k vocabulary;
``--quick`` leaves it out). Rate: generated tokens per second, median of 3 calls after a warm-up; the ratio is
vLLM's rate over generate's (> 1: vLLM faster).
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
from benchmarks.common import emit_results  # noqa: E402
from benchmarks.rollout_throughput import make_prompts  # noqa: E402

# name -> Qwen2 overrides; heads of 64 dimensions (vLLM's CPU attention takes no smaller ones)
SIZES = {
    "hidden 128 x 2 layers": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=512, num_attention_heads=2),
    "hidden 512 x 8 layers": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=2048, num_attention_heads=8),
    "hidden 768 x 12 layers": dict(
        hidden_size=768, num_hidden_layers=12, intermediate_size=3072, num_attention_heads=12
    ),
}


def rate(engine, prompts, sampling) -> tuple[float, int]:
    """(generated tokens per second, tokens per call): median of 3 calls after one warm-up."""
    engine.generate(prompts, sampling)
    times, tokens = [], 0
    for _ in range(3):
        start = time.perf_counter()
        out = engine.generate(prompts, sampling)
        times.append(time.perf_counter() - start)
        tokens = int(out.batch["response_mask"].sum())
    return tokens / statistics.median(times), tokens


def measure(model_dir: str, tokenizer, shape: tuple[int, int, int]) -> dict[str, float]:
    from backends.rollout.hf import HFRolloutEngine
    from backends.rollout.vllm_engine import VLLMRolloutEngine

    prompts_n, n, new = shape
    tokenizer.padding_side = "left"
    prompts = make_prompts(tokenizer, prompts_n)
    sampling = SamplingConfig(n=n, temperature=1.0, max_new_tokens=new, seed=0)
    config = RolloutConfig(model_path=model_dir, max_model_len=256, kv_cache_bytes=256 << 20)
    torch.set_num_threads(1)
    vllm_rate, _ = rate(VLLMRolloutEngine(config, tokenizer), prompts, sampling)
    torch.set_num_threads(1)
    hf_rate, tokens = rate(HFRolloutEngine(config, tokenizer), prompts, sampling)
    return {"vllm": vllm_rate, "hf": hf_rate, "tokens": tokens}


def main() -> None:
    from transformers import AutoTokenizer

    from tests.backends.tiny import make_tokenizer, save_tiny_qwen2

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 prompts x 2 x 16 tokens (else 16 x 2 x 32), no SmolLM2")
    args = parser.parse_args()
    shape = (8, 2, 16) if args.quick else (16, 2, 32)
    models = {}
    work = tempfile.mkdtemp(prefix="bench-crossover-")
    for name, overrides in SIZES.items():
        models[name] = (
            save_tiny_qwen2(os.path.join(work, str(len(models))), **overrides, num_key_value_heads=2),
            make_tokenizer(),
        )
    if not args.quick:
        from scaletrain.models.prepare import prepare_model

        path = prepare_model("smollm2")
        models["SmolLM2-135M (49k vocabulary)"] = (path, AutoTokenizer.from_pretrained(path))
    print(f"{'model':<32}{'params':>10}{'vLLM tok/s':>12}{'generate tok/s':>16}{'vLLM / generate':>17}")
    rows = []
    for name, (path, tokenizer) in models.items():
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            params = sum(
                p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).parameters()
            )
        result = measure(path, tokenizer, shape)
        ratio = result["vllm"] / result["hf"]
        print(f"{name:<32}{params / 1e6:>9.1f}M{result['vllm']:>12,.0f}{result['hf']:>16,.0f}{ratio:>16.2f}x")
        rows.append(
            (f"generated tokens/s, {name}: vLLM vs generate", result["vllm"], result["hf"], "generate", "tok/s")
        )
    emit_results(rows)


if __name__ == "__main__":
    main()
