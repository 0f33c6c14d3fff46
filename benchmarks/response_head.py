"""The LM head fused with the log-probs and entropy (backends/response_head.py) against the logits path: peak memory
and time of one training forward + backward of a micro-batch's log-probs and entropy.

    python benchmarks/response_head.py            # tiny model, 150k vocabulary, 2k and 8k response tokens;
                                                  # SmolLM2-135M (49k vocabulary), 2k response tokens
    python benchmarks/response_head.py --quick    # tiny model, 150k vocabulary, 512 and 2k response tokens

One row of 64 prompt + N response tokens (the padded path: the head sees the N + 1 last positions), fp32, one
thread. Each variant runs in a fresh process: the peak is the process's largest resident set during the step
minus its size before it (``ru_maxrss``), so the model's own memory is not counted; time is the median of 3 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT = 64
CASES = {
    "quick": [("tiny", 150_000, 512), ("tiny", 150_000, 2048)],
    "full": [("tiny", 150_000, 2048), ("tiny", 150_000, 8192), ("smollm2", None, 2048)],
}


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def measure(model_dir: str, tokens: int, fused: bool) -> dict:
    """In this (fresh) process: one step for the peak, then the median of 3 for the time."""
    import torch

    from backends.config import ModelConfig
    from backends.hf_model import build_model, forward_micro_batch
    from tests.backends.tiny import make_batch

    torch.set_num_threads(1)
    model = build_model(ModelConfig(path=model_dir, dtype="float32"))
    vocab = model.config.vocab_size
    batch = make_batch(1, PROMPT, tokens, vocab_size=vocab, min_prompt=PROMPT, min_response=tokens).batch

    def step() -> None:
        out = forward_micro_batch(model, batch, ("log_probs", "entropy"), fused_head=fused)
        (out["log_probs"].sum() + 0.01 * out["entropy"].sum()).backward()
        model.zero_grad(set_to_none=True)

    before = _rss_kib()
    step()
    peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    times = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"peak_mib": peak_mib, "ms": sorted(times)[1] * 1000}


def _model_dir(name: str, vocab: int | None, work: str) -> str:
    if name == "smollm2":
        from scaletrain.models.prepare import prepare_model

        return prepare_model("smollm2")
    from tests.backends.tiny import save_tiny_qwen2

    return save_tiny_qwen2(os.path.join(work, f"tiny_{vocab}"), vocab_size=vocab, with_tokenizer=False)


def _run_child(model_dir: str, tokens: int, fused: bool) -> dict | None:
    """``measure`` in a fresh process; None when it fails (killed for memory: the 24 GiB machine's limit)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from benchmarks.response_head import measure; "
        "print('RESULT ' + json.dumps(measure(sys.argv[2], int(sys.argv[3]), sys.argv[4] == '1')))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [sys.executable, "-c", code, root, model_dir, str(tokens), "1" if fused else "0"]
    out = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode != 0:
        print(f"{'fused' if fused else 'logits'} path at {tokens} tokens failed (exit {out.returncode})")
        return None
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _cell(result: dict | None, key: str, width: int) -> str:
    return f"{result[key]:>{width}.0f}" if result else f"{'failed':>{width}}"


def main() -> None:
    from benchmarks.common import emit_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = []
    print(f"\n{'case':<28}{'logits MiB':>12}{'fused MiB':>11}{'logits ms':>11}{'fused ms':>10}")
    with tempfile.TemporaryDirectory() as work:
        for name, vocab, tokens in CASES["quick" if args.quick else "full"]:
            model_dir = _model_dir(name, vocab, work)
            plain, fused = _run_child(model_dir, tokens, False), _run_child(model_dir, tokens, True)
            case = f"{name} {vocab or 49152} vocab, {tokens} tok"
            memory = _cell(plain, "peak_mib", 12) + _cell(fused, "peak_mib", 11)
            print(f"{case:<28}{memory}{_cell(plain, 'ms', 11)}{_cell(fused, 'ms', 10)}")
            for key, measure, unit in (("peak_mib", "peak MiB", "MiB"), ("ms", "step ms", "ms")):
                if fused is not None:
                    base = plain[key] if plain else None
                    rows.append((f"{measure}, {case}", fused[key], base, "logits path", unit))
    emit_results(rows)


if __name__ == "__main__":
    main()
