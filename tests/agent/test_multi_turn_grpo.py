"""End to end: multi-turn GRPO on CPU through an in-process run of the CLI's (Ray, 2 FSDP ranks, HF rollout on each
rank, the agent loops on the driver) with a tiny model warmed up to call the calculator (tests/agent/warmup.py).

The data rows pick ``agent_name: tool_agent`` and pass the ground truth to the calculator via ``tools_kwargs``;
the tool's use shows in the step metrics (``num_turns/*``, ``agent/tool_calls``, ``agent/tool_errors``).
"""

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def write_data(path: Path, n: int, seed: int) -> str:
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append(
            {
                "data_source": "calc",
                "prompt": [{"role": "user", "content": f"{a}+{b}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "agent_name": "tool_agent",
                "extra_info": {
                    "index": i,
                    "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": str(a + b)}}},
                },
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_multi_turn_grpo_uses_the_calculator(ray_cluster, tool_model, tmp_path):
    from scaletrain.trainer.main_ppo import run

    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: calculator\n")
    run_dir = tmp_path / "run"
    overrides = [
        "rollout=hf",
        f"actor_rollout_ref.model.path={tool_model}",
        f"data.train_files={write_data(tmp_path / 'train.parquet', 32, 0)}",
        f"data.val_files={write_data(tmp_path / 'val.parquet', 4, 1)}",
        "data.train_batch_size=4",
        "data.max_prompt_length=24",
        "data.max_response_length=64",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tools_config_file={tools}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        f"custom_reward_function.path={Path(__file__).parent / 'calc_reward.py'}",
        "trainer.total_training_steps=3",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[jsonl]",
        "trainer.save_hf_at_end=false",
        "trainer.plot_at_end=false",
        "trainer.save_freq=-1",
        "reward_model.num_processes=1",
    ]
    run(overrides)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r["step"] >= 1 and "agent/tool_calls" in r]
    assert len(steps) == 3
    for r in steps:
        assert r["agent/tool_calls"] > 0 and r["num_turns/mean"] > 2  # the model called the calculator
        assert "agent/tool_errors" in r and "num_turns/max" in r and "actor/pg_loss" in r
        assert r["agent/generate_batches"] >= 2 and r["agent/mean_batch_size"] > 1
    assert "val/calc/acc" in rows[-1]
