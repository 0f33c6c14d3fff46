"""The SFT trainer: batch layout, config errors before Ray, and a short 2-rank FSDP run on the embedded task
(loss falls, early stop at the first evaluation, an HF checkpoint transformers loads)."""

import json

import pytest
import torch

from scaletrain.utils.typed_config import ConfigError

N_TRAIN = 2000


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    from scaletrain.data import build_embedded_default

    return build_embedded_default(cache_dir=tmp_path_factory.mktemp("embedded"), n_train=N_TRAIN, n_val=64, n_test=8)


def dotted(tree: dict, prefix: str = ""):
    """(dotted key, value) of each leaf of a nested config dict, as command-line overrides name them."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from dotted(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", "[" + ",".join(value) + "]" if isinstance(value, list) else value


def sft_config(paths, out_dir, **trainer):
    return {
        "data": {
            "train_files": paths["sft_train"],
            "val_files": paths["sft_val"],
            "val_prompts_file": paths["val"],
            "train_batch_size": 64,
            "micro_batch_size_per_gpu": 32,
            "max_prompt_length": 8,
            "max_response_length": 5,
        },
        "model": {"path": paths["model"]},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "grad_clip": 0.0},
        "trainer": {
            "n_gpus_per_node": 2,
            "default_local_dir": str(out_dir),
            "logger": ["jsonl"],
            "test_freq": 10,
            **trainer,
        },
    }


def test_batch_layout_verl_style(embedded):
    from transformers import AutoTokenizer

    from scaletrain.data.sft_dataset import SFTDataset

    tok = AutoTokenizer.from_pretrained(embedded["model"])
    ds = SFTDataset(embedded["sft_val"], tok, max_prompt_length=10, max_response_length=6)
    batch = ds.get_batch([0, 1]).batch
    assert batch["input_ids"].shape == (2, 16) and batch["responses"].shape == (2, 6)
    mask, resp_mask = batch["attention_mask"], batch["response_mask"]
    assert mask[:, :2].sum() == 0 and mask[:, 2:10].all()  # 8-token prompts, left-padded
    assert torch.equal(mask[:, 10:], resp_mask)
    for row in range(2):
        n = int(resp_mask[row].sum())
        assert resp_mask[row, :n].all() and not resp_mask[row, n:].any()  # right-padded
        assert batch["responses"][row, n - 1] == tok.eos_token_id
        text = tok.decode(batch["input_ids"][row][mask[row].bool()])
        a, b = text.split("=")[0].split("+")
        assert text == f"{a}+{b}={int(a) + int(b)}<eos>"
    assert batch["position_ids"][0, 2:11].tolist() == list(range(9))
    with pytest.raises(ValueError, match="max_response_length=4"):
        SFTDataset(embedded["sft_val"], tok, max_prompt_length=10, max_response_length=4)


def test_yaml_defaults_equal_dataclass_defaults():
    from dataclasses import replace

    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from scaletrain.trainer.config.sft_config import SFTConfig, load_sft_config

    with initialize_config_module("scaletrain.configs", version_base=None):
        raw = compose("sft_trainer", overrides=["trainer.experiment_name=warmup"])
    raw = OmegaConf.to_container(raw, resolve=True)
    raw.pop("hydra", None)
    cfg = load_sft_config(raw)
    assert cfg.output_dir == "outputs/scaletrain/warmup" and cfg.model.path is None
    # the embedded default's warm-up recipe, in the YAML and in the dataclasses (run_sft on a dict) alike
    assert (cfg.data.train_batch_size, cfg.optim.lr, cfg.optim.warmup_steps) == (128, 1e-3, 100)
    assert (cfg.trainer.test_freq, cfg.trainer.stop_at_val_acc, cfg.world_size) == (25, 0.15, 2)
    default = SFTConfig()
    default = replace(
        default,
        trainer=replace(default.trainer, experiment_name="warmup", default_local_dir=cfg.trainer.default_local_dir),
    )
    assert cfg == default


@pytest.mark.parametrize(
    "override, key",
    [
        ({"data": {"train_batch_size": 63}}, "data.train_batch_size"),
        ({"data": {"train_batch_sizee": 64}}, "data.train_batch_sizee"),
        ({"trainer": {"stop_at_val_acc": 1.5}}, "trainer.stop_at_val_acc"),
        ({"data": {"response_key": "answer"}}, "data.response_key"),
    ],
)
def test_config_error_names_key_before_ray(embedded, tmp_path, monkeypatch, override, key):
    import ray

    from scaletrain.trainer import sft_trainer

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init called before validation failed"))
    monkeypatch.setattr(ray, "is_initialized", lambda: pytest.fail("Ray touched before validation failed"))
    cfg = sft_config(embedded, tmp_path)
    for section, values in override.items():
        cfg[section].update(values)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        sft_trainer.run_sft(cfg)


@pytest.mark.slow
def test_sft_run_learns_stops_early_and_saves_hf(ray_cluster, embedded, tmp_path):
    """Through ``main_sft.run``: the command line's overrides, in this process."""
    from transformers import AutoModelForCausalLM

    from scaletrain.trainer.main_sft import run

    cfg = sft_config(embedded, tmp_path, total_steps=100, stop_at_val_acc=0.0, test_freq=12)
    summary = run([f"{key}={value}" for key, value in dotted(cfg)])
    assert summary["run_dir"] == str(tmp_path)
    # accuracy >= 0.0 holds at the first evaluation: stops there, not at total_steps
    assert summary["step"] == 12 and summary["stopped_early"] and 0.0 <= summary["val_acc"] <= 1.0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    losses = [r["sft/loss"] for r in records]
    assert losses[-1] < 0.8 * losses[0], losses
    assert records[-1]["val/loss"] < losses[0] and "val/acc" in records[-1]
    assert records[0]["sft/lr"] == pytest.approx(1.5e-3) and records[-1]["sft/lr"] == pytest.approx(3e-3)

    model = AutoModelForCausalLM.from_pretrained(summary["hf_path"])
    start = AutoModelForCausalLM.from_pretrained(embedded["model"])
    assert set(model.state_dict()) == set(start.state_dict())
    assert not torch.equal(model.state_dict()["model.norm.weight"], start.state_dict()["model.norm.weight"])


@pytest.mark.slow
def test_sft_worker_checkpoint_roundtrip_and_greedy_sync(ray_cluster, embedded, tmp_path):
    """load_checkpoint restores the engine exactly, and generate() sees the restored weights, not the trained ones."""
    from transformers import AutoTokenizer

    from backends.config import ModelConfig, OptimConfig
    from scaletrain.data import RLDataset
    from scaletrain.data.sft_dataset import SFTDataset
    from scaletrain.workers.config import EngineSetup
    from scaletrain.workers.sft import SFTWorker, SFTWorkerConfig
    from tests.controller.workers import started_group

    tok = AutoTokenizer.from_pretrained(embedded["model"])
    data = SFTDataset(embedded["sft_train"], tok, max_prompt_length=8, max_response_length=5)
    prompts = RLDataset(embedded["val"], tok, 8, max_samples=8)
    prompts = prompts.get_batch(range(len(prompts))).select(
        batch_keys=["input_ids", "attention_mask", "position_ids"], non_tensor_batch_keys=[]
    )
    config = SFTWorkerConfig(optim=OptimConfig(lr=1e-2), max_prompt_length=8, max_response_length=5)
    setup = EngineSetup(model=ModelConfig(path=embedded["model"]))
    with started_group(ray_cluster, 2, SFTWorker, config, setup, use_gpu=False, name_prefix="sft_ckpt") as wg:
        wg.init_model()
        batch = data.get_batch(range(16))
        wg.train_batch(batch)
        wg.save_checkpoint(str(tmp_path / "ckpt"))
        saved_loss, saved_gen = wg.eval_loss(batch), wg.generate(prompts)
        for _ in range(3):
            wg.train_batch(batch)
        assert not torch.equal(wg.eval_loss(batch).batch["nll_sum"], saved_loss.batch["nll_sum"])
        trained_lp = wg.generate(prompts).batch["rollout_log_probs"]  # greedy: log-probs of the raw logits
        assert not torch.allclose(trained_lp, saved_gen.batch["rollout_log_probs"])
        wg.load_checkpoint(str(tmp_path / "ckpt"))
        assert torch.equal(wg.eval_loss(batch).batch["nll_sum"], saved_loss.batch["nll_sum"])
        restored = wg.generate(prompts)
        assert torch.equal(restored.batch["responses"], saved_gen.batch["responses"])
        assert torch.allclose(restored.batch["rollout_log_probs"], saved_gen.batch["rollout_log_probs"])
