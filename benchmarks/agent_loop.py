"""Agent-loop rollout throughput: concurrent trajectories per second on the async path vs the single-turn path.

    python benchmarks/agent_loop.py [--quick]

One in-process vLLM engine (HF with --engine hf) serves every row; the model is the tiny Qwen2 warmed up to
call the calculator (tests/agent/warmup.py, a few seconds of SFT). Rows:
- ``sync single-turn``: ``engine.generate`` on the whole batch (the sync rollout path): the baseline.
- ``agent single_turn_agent``: the same prompts through AgentLoopManager -> AsyncServerManager -> the same
  engine (token-level requests, batching): the async path's overhead.
- ``agent tool_agent``: multi-turn trajectories (tool call, calculator, answer: 2 model turns each), all
  concurrent; and the same trajectories run one at a time (``sequential``), which is what concurrency buys.
- ``agent tool_agent, vLLM AsyncLLM``: the same concurrent trajectories with every request sent at once to vLLM's
  async engine (the rollout workers' default, ``rollout.async_engine``), which batches continuously, instead of
  the driver-side batcher's flushes; its ratio is to the batcher's row (vllm only).
Figures are trajectories per second (higher is better); ratio = ours / baseline.
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

from backends.rollout.base import RolloutConfig, SamplingConfig, get_rollout  # noqa: E402
from benchmarks.common import emit_results  # noqa: E402
from scaletrain.agent.manager import AgentLoopManager  # noqa: E402
from scaletrain.agent.server import AsyncServerManager, LocalAsyncEngineBackend, LocalEngineBackend  # noqa: E402
from scaletrain.protocol import DataProto  # noqa: E402
from scaletrain.workers.config import MultiTurnConfig  # noqa: E402
from tests.agent.helpers import make_agent_tokenizer  # noqa: E402
from tests.agent.warmup import build_tool_model  # noqa: E402

RESPONSE = 64


def rows_for(questions: list[str], agent_name: str) -> DataProto:
    def obj(values):
        arr = np.empty(len(values), dtype=object)
        arr[:] = values
        return arr

    raw = obj([[{"role": "user", "content": q}] for q in questions])
    return DataProto.from_dict(
        non_tensors={
            "raw_prompt": raw,
            "agent_name": obj([agent_name] * len(questions)),
            "extra_info": obj([{} for _ in questions]),
        }
    )


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sync_generate_s(engine, tok, questions: list[str], n: int, reps: int) -> float:
    """Median seconds of the sync single-turn path: one batched ``engine.generate`` over all prompts."""
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])
    prompts = DataProto.from_dict({"input_ids": input_ids, "attention_mask": (input_ids != 0).long()})
    sampling = SamplingConfig(n=n, temperature=1.0, max_new_tokens=RESPONSE, seed=0)
    return median_s(lambda: engine.generate(prompts, sampling), reps)


def agent_paths_s(manager: AgentLoopManager, questions: list[str], n: int, reps: int) -> tuple[dict, dict]:
    """Median seconds per path of the agent loop ({single, tool, sequential}) and the tool_agent run's metrics.
    ``sequential`` times up to 8 one-trajectory calls and scales to the whole batch."""
    params = {"temperature": 1.0, "seed": 0}
    trajectories = len(questions) * n
    single = median_s(lambda: manager.generate_sequences(rows_for(questions, "single_turn_agent"), params, n), reps)
    tool_rows = rows_for(questions, "tool_agent")
    last = {}

    def tool_run():
        last["out"] = manager.generate_sequences(tool_rows, params, n)

    tool = median_s(tool_run, reps)
    one, calls = rows_for(questions[:1], "tool_agent"), min(8, trajectories)
    sequential = median_s(lambda: [manager.generate_sequences(one, params, 1) for _ in range(calls)], 1)
    seconds = {"single": single, "tool": tool, "sequential": sequential / calls * trajectories}
    return seconds, last["out"].meta_info["metrics"]


def async_engine_tool_s(model_dir: str, tok, cfg: MultiTurnConfig, questions: list[str], n: int, reps: int) -> float:
    """Median seconds of the concurrent tool_agent run on vLLM's AsyncLLM (each request submitted at once)."""
    engine = get_rollout("vllm_async")(
        RolloutConfig(model_path=model_dir, max_model_len=256, kv_cache_bytes=64 << 20), tok
    )
    torch.set_num_threads(1)
    try:
        server = AsyncServerManager(LocalAsyncEngineBackend([engine]))
        manager = AgentLoopManager(cfg, server, tok, prompt_length=32, response_length=RESPONSE)
        rows, params = rows_for(questions, "tool_agent"), {"temperature": 1.0, "seed": 0}
        return median_s(lambda: manager.generate_sequences(rows, params, n), reps)
    finally:
        engine.close()


def report(tps: dict[str, float], metrics: dict, header: str) -> None:
    """Print the table (trajectories/s per path, ratio to the sync baseline) and emit the results."""
    print(header)
    print(
        f"tool_agent: {metrics['num_turns/mean']:.2f} turns/trajectory, "
        f"{metrics['agent/tool_calls_per_traj']:.2f} tool calls/trajectory, "
        f"{metrics['agent/generate_batches']:.0f} engine batches (mean {metrics['agent/mean_batch_size']:.1f})"
    )
    print(f"\n{'path':<42}{'traj/s':>10}{'vs sync single-turn':>22}")
    table = [
        ("sync single-turn generate (baseline)", tps["sync"]),
        ("agent single_turn_agent (async path)", tps["single"]),
        ("agent tool_agent, concurrent (2 turns)", tps["tool"]),
        ("agent tool_agent, one at a time", tps["sequential"]),
    ]
    if "async_tool" in tps:
        table.append(("agent tool_agent, vLLM AsyncLLM", tps["async_tool"]))
    for name, value in table:
        print(f"{name:<42}{value:>10.1f}{value / tps['sync']:>21.2f}x")
    sync = "sync single-turn generate"
    rows = [
        ("agent single_turn_agent traj/s", tps["single"], tps["sync"], sync),
        ("agent tool_agent concurrent traj/s", tps["tool"], tps["sync"], sync),
        ("agent tool_agent one-at-a-time traj/s", tps["sequential"], tps["tool"], "tool_agent concurrent"),
    ]
    if "async_tool" in tps:
        rows.append(("agent tool_agent AsyncLLM traj/s", tps["async_tool"], tps["tool"], "tool_agent batcher"))
    emit_results(
        [
            {"measure": m, "ours": ours, "baseline": base, "baseline_name": base_name, "unit": "traj/s"}
            for m, ours, base, base_name in rows
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 prompts x 2 samples, 3 repeats")
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    args = parser.parse_args()
    prompts_n, n, reps = (16, 2, 3) if args.quick else (64, 4, 5)
    torch.set_num_threads(1)
    tok = make_agent_tokenizer()
    tmp = tempfile.mkdtemp(prefix="bench-agent-")
    model_dir = build_tool_model(os.path.join(tmp, "model"), steps=150)
    engine = get_rollout(args.engine)(
        RolloutConfig(model_path=model_dir, max_model_len=256, kv_cache_bytes=64 << 20), tok
    )
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    questions = [f"{a}+{b}" for a, b in rng.integers(10, 100, (prompts_n, 2))]
    trajectories = prompts_n * n
    sync_s = sync_generate_s(engine, tok, questions, n, reps)

    tools = os.path.join(tmp, "tools.yaml")
    Path(tools).write_text("tools:\n  - class_name: calculator\n")
    cfg = MultiTurnConfig(enable=True, tools_config_file=tools, max_assistant_turns=2)
    manager = AgentLoopManager(
        cfg, AsyncServerManager(LocalEngineBackend([engine])), tok, prompt_length=32, response_length=RESPONSE
    )
    seconds, metrics = agent_paths_s(manager, questions, n, reps)
    if args.engine == "vllm":
        seconds["async_tool"] = async_engine_tool_s(model_dir, tok, cfg, questions, n, reps)
    tps = {path: trajectories / s for path, s in {"sync": sync_s, **seconds}.items()}
    header = (
        f"\n{prompts_n} prompts x n={n} = {trajectories} trajectories, {args.engine} engine, tiny tool-calling "
        f"Qwen2, response <= {RESPONSE} tokens, 1 thread; median of {reps}"
    )
    report(tps, metrics, header)


if __name__ == "__main__":
    main()
