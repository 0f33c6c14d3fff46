"""Validation like verl's, through the trainer (an in-process run of the CLI's): val_kwargs.n=4 sampled at temperature
1.0 gives mean@4 / best@k / worst@k / maj@k metrics; rollouts and validation samples are dumped as JSONL; a few
validation samples reach every logger (console, jsonl, tensorboard text, wandb table)."""

import json

import pytest

from scaletrain.trainer.step.val_metrics import validation_metrics
from tests.trainer.runs import metrics, run_in_process

pytestmark = pytest.mark.slow

VAL_PROMPTS, VAL_N, TRAIN_PROMPTS, TRAIN_N = 8, 4, 4, 2
SOURCE = "scaletrain/arithmetic"

# The untrained tiny model almost never answers right, so the run scores a format reward that varies between
# samples (does the answer start with a digit?) and votes on that first character.
REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    pred = solution_str.strip()[:1]
    return {"score": float(pred.isdigit()), "pred": pred}
"""


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_trainer(task, tmp_path, monkeypatch, capsys):
    """Two GRPO steps of the resume test's run, validating before and after, with the outputs under test on."""
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    overrides = [
        f"actor_rollout_ref.rollout.val_kwargs.n={VAL_N}",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        f"data.val_max_samples={VAL_PROMPTS}",
        f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
        f"trainer.validation_data_dir={tmp_path / 'val'}",
        "trainer.log_val_generations=2",
        "trainer.logger=[console,jsonl,tensorboard,wandb]",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.save_hf_at_end=false",
        "trainer.plot_at_end=false",
        f"custom_reward_function.path={reward_file}",
    ]
    home = str(tmp_path / "wandb-home")
    wandb_env = dict(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONFIG_DIR=home, WANDB_CACHE_DIR=home)
    for name, value in dict(wandb_env, WANDB_DATA_DIR=home).items():
        monkeypatch.setenv(name, value)
    run_in_process(task, tmp_path / "run", 2, overrides)
    return capsys.readouterr().out  # the console logger's lines


def check_validation(row, dumped):
    """The logged metrics of one validation: verl's names, and the same figures recomputed from its dump."""
    core, aux = f"val-core/{SOURCE}/reward", f"val-aux/{SOURCE}/reward"
    for name in ("mean@4", "best@4/mean", "best@4/std", "maj@4/mean", "maj@4/std"):
        assert 0.0 <= row[f"{core}/{name}"] <= 1.0, name
    for name in ("std@4", "best@2/mean", "worst@2/mean", "worst@4/std", "maj@2/mean"):
        assert f"{aux}/{name}" in row, name
    assert row[f"{core}/mean@4"] == pytest.approx(row[f"val/{SOURCE}/acc"])
    assert row[f"{aux}/worst@4/mean"] < row[f"{core}/mean@4"] < row[f"{core}/best@4/mean"]
    recomputed = validation_metrics(
        [r["data_source"] for r in dumped],
        [r["input"] for r in dumped],
        {"reward": [r["score"] for r in dumped], "pred": [r["pred"] for r in dumped]},
    )
    assert recomputed == pytest.approx({k: v for k, v in row.items() if f"{SOURCE}/reward/" in k}, abs=1e-9)


def test_validation_metrics_dumps_and_logged_generations(ray_cluster, task, tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    stdout = run_trainer(task, tmp_path, monkeypatch, capsys)
    run_dir, by_step = tmp_path / "run", metrics(tmp_path / "run")

    assert sorted(p.name for p in (tmp_path / "val").iterdir()) == ["0.jsonl", "2.jsonl"]
    for step in (0, 2):  # validation before training and after the last step
        dumped = read_jsonl(tmp_path / "val" / f"{step}.jsonl")
        assert len(dumped) == VAL_PROMPTS * VAL_N
        assert all({"input", "output", "gts", "score", "step", "pred"} <= set(r) and r["step"] == step for r in dumped)
        outputs = {}
        for r in dumped:
            outputs.setdefault(r["input"], set()).add(r["output"])
        assert len(outputs) == VAL_PROMPTS and any(len(o) > 1 for o in outputs.values())  # sampled, not greedy
        check_validation(by_step[step], dumped)
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["1.jsonl", "2.jsonl"]
    for step in (1, 2):
        dumped = read_jsonl(tmp_path / "rollouts" / f"{step}.jsonl")
        assert len(dumped) == TRAIN_PROMPTS * TRAIN_N and all(r["step"] == step and "gts" in r for r in dumped)
        assert sum(r["score"] for r in dumped) == pytest.approx(by_step[step]["critic/score/mean"] * len(dumped))

    # logged generations: 2 per validation, the same prompts each time, in every logger
    logged = read_jsonl(run_dir / "val_generations.jsonl")
    assert [r["step"] for r in logged] == [0, 0, 2, 2]
    assert [r["input"] for r in logged[:2]] == [r["input"] for r in logged[2:]]
    assert "validation samples at step 2:" in stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("val/generations/text_summary")}
    assert sorted(texts) == [0, 2] and logged[0]["input"] in texts[0]
    tables = list((run_dir / "wandb").glob("offline-run-*/files/media/table/val/generations_*.table.json"))
    assert len(tables) == 2
    rows = max((json.loads(t.read_text())["data"] for t in tables), key=len)
    assert [r[0] for r in rows] == [0, 0, 2, 2] and rows[0][1] == logged[0]["input"]
