"""`make run` shortened: the embedded default with no model/data arguments (SFT warm-up, then GRPO through Ray,
2 FSDP ranks and vLLM rollout) must learn: the training reward rises and held-out accuracy does not fall."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 150


def test_embedded_default_learns(tmp_path):
    pytest.importorskip("vllm")
    run_dir = tmp_path / "run"
    # the scaletrain cache every embedded-default run of the session shares: on a fresh machine the first such run
    # (this one or another) builds the model and the SFT warm-up, as `make run` does
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaletrain.trainer.main_ppo",
            f"trainer.total_training_steps={STEPS}",
            f"trainer.default_local_dir={run_dir}",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {row["step"]: row for row in rows}
    assert sorted(by_step) == list(range(STEPS + 1))
    score = [by_step[s]["critic/score/mean"] for s in range(1, STEPS + 1)]
    first, last = np.mean(score[:30]), np.mean(score[-30:])
    assert last > first + 0.02, (first, last)  # measured: ~0.08 -> ~0.12 over 150 steps
    acc_key = "val/scaletrain/arithmetic/acc"
    assert by_step[0][acc_key] > 0.1  # the SFT warm-up worked
    assert by_step[STEPS][acc_key] >= by_step[0][acc_key] - 0.02
    # the run's outputs: an HF export that transformers and vLLM load, and curves
    from transformers import AutoModelForCausalLM

    hf = str(run_dir / "hf")
    AutoModelForCausalLM.from_pretrained(hf)
    load_in_vllm = (  # in a fresh process: one in-process vLLM engine per process
        "import torch; from transformers import AutoTokenizer; "
        "from backends.rollout.base import RolloutConfig, SamplingConfig, get_rollout; "
        "from scaletrain.protocol import DataProto; "
        f"tok = AutoTokenizer.from_pretrained({hf!r}); "
        "ids = torch.tensor([tok('123+456=', add_special_tokens=False)['input_ids']]); "
        f"engine = get_rollout('vllm')(RolloutConfig(model_path={hf!r}, max_model_len=16), tok); "
        "p = DataProto.from_dict({'input_ids': ids, 'attention_mask': torch.ones_like(ids), "
        "'position_ids': torch.arange(ids.shape[1])[None]}); "
        "out = engine.generate(p, SamplingConfig(temperature=0.0, max_new_tokens=5)); "
        "print('VLLM_OK', tuple(out.batch['responses'].shape))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", load_in_vllm], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert "VLLM_OK (1, 5)" in loaded.stdout, loaded.stderr[-3000:]
    assert (run_dir / "plots" / "reward.png").stat().st_size > 5000
    assert "points)" in out.stdout  # the summary table
    # the console shows our own lines; the libraries' INFO lines, the workers' too, are in the run log only
    assert re.search(r"INFO \[\w+ rank \d+ pid \d+\] vllm\.", (run_dir / "run.log").read_text())
    assert not re.search(r"\bINFO\b", out.stdout + out.stderr), "a library's INFO line reached the console"
