"""Logits only where they count, against the logits they replace: peak memory and time of one training forward +
backward of a micro-batch's log-probs and entropy.

    python benchmarks/response_head.py            # tiny model, 150k vocabulary, 2k and 8k response tokens;
                                                  # SmolLM2-135M (49k vocabulary), 2k response tokens; megatron
    python benchmarks/response_head.py --quick    # tiny model, 150k vocabulary, 512 and 2k response tokens
    python benchmarks/response_head.py --engine megatron   # one engine's cases only

HF models (the fsdp / deepspeed forward, backends/hf_model.py): the LM head fused with the log-probs and entropy
(backends/sequence/response_head.py) against the logits path. Megatron (a one-rank engine's train_step): the head on
the response-predicting positions only (backends/megatron/ops.py) against the head on every position. One row of 64
prompt + N response tokens (HF: the padded path, the head sees the N + 1 last positions), fp32, one
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
CASES = {  # (model, vocabulary, response tokens, engine: "hf" = backends/hf_model.py's forward, as fsdp / deepspeed)
    "quick": [("tiny", 150_000, 512, "hf"), ("tiny", 150_000, 2048, "hf"), ("tiny", 150_000, 2048, "megatron")],
    "full": [
        ("tiny", 150_000, 2048, "hf"),
        ("tiny", 150_000, 8192, "hf"),
        ("smollm2", None, 2048, "hf"),
        ("tiny", 150_000, 2048, "megatron"),
        ("tiny", 150_000, 8192, "megatron"),
    ],
}


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _hf_step(model_dir: str, tokens: int, fused: bool):
    """One forward + backward of the HF forward's log-probs and entropy (fused head or logits path)."""
    from backends.config import ModelConfig
    from backends.hf_model import build_model, forward_micro_batch
    from tests.backends.tiny import make_batch

    model = build_model(ModelConfig(path=model_dir, dtype="float32"))
    vocab = model.config.vocab_size
    batch = make_batch(1, PROMPT, tokens, vocab_size=vocab, min_prompt=PROMPT, min_response=tokens).batch

    def step() -> None:
        out = forward_micro_batch(model, batch, ("log_probs", "entropy"), fused_head=fused)
        (out["log_probs"].sum() + 0.01 * out["entropy"].sum()).backward()
        model.zero_grad(set_to_none=True)

    return step


def _megatron_step(model_dir: str, tokens: int, head_only: bool):
    """One train_step of a one-rank megatron engine (its head at the response positions only, or at all)."""
    from backends.base import get_backend
    from backends.config import EngineConfig, ModelConfig, OptimConfig
    from scaletrain.utils.net import free_port, local_rank_env
    from tests.backends.reference import actor_loss
    from tests.backends.tiny import make_batch

    os.environ.update({k: v for k, v in local_rank_env(0, 1, free_port(), "").items() if k != "PYTHONPATH"})
    engine = get_backend("megatron")(ModelConfig(path=model_dir), OptimConfig(lr=1e-5), EngineConfig())
    engine.response_head_only = head_only
    vocab = engine.hf_config.vocab_size
    data = make_batch(1, PROMPT, tokens, vocab_size=vocab, min_prompt=PROMPT, min_response=tokens)
    return lambda: engine.train_step(data, actor_loss, ("log_probs", "entropy"))


def measure(model_dir: str, tokens: int, fused: bool, engine: str = "hf") -> dict:
    """In this (fresh) process: one step for the peak, then the median of 3 for the time."""
    import torch

    torch.set_num_threads(1)
    step = (_megatron_step if engine == "megatron" else _hf_step)(model_dir, tokens, fused)
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


def _run_child(model_dir: str, tokens: int, fused: bool, engine: str) -> dict | None:
    """``measure`` in a fresh process; None when it fails (killed for memory: the 24 GiB machine's limit)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from benchmarks.response_head import measure; "
        "print('RESULT ' + json.dumps(measure(sys.argv[2], int(sys.argv[3]), sys.argv[4] == '1', sys.argv[5])))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [sys.executable, "-c", code, root, model_dir, str(tokens), "1" if fused else "0", engine]
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
    parser.add_argument("--engine", choices=("hf", "megatron"), help="only this engine's cases")
    args = parser.parse_args()
    rows = []
    print(f"\n{'case':<38}{'before MiB':>12}{'after MiB':>11}{'before ms':>11}{'after ms':>10}")
    with tempfile.TemporaryDirectory() as work:
        for name, vocab, tokens, engine in CASES["quick" if args.quick else "full"]:
            if args.engine not in (None, engine):
                continue
            model_dir = _model_dir(name, vocab, work)
            plain, fused = _run_child(model_dir, tokens, False, engine), _run_child(model_dir, tokens, True, engine)
            case = f"{engine} {name} {vocab or 49152} vocab, {tokens} tok"
            memory = _cell(plain, "peak_mib", 12) + _cell(fused, "peak_mib", 11)
            print(f"{case:<38}{memory}{_cell(plain, 'ms', 11)}{_cell(fused, 'ms', 10)}")
            for key, measure, unit in (("peak_mib", "peak MiB", "MiB"), ("ms", "step ms", "ms")):
                if fused is not None:
                    base = plain[key] if plain else None
                    rows.append((f"{measure}, {case}", fused[key], base, "all logits", unit))
    emit_results(rows)


if __name__ == "__main__":
    main()
