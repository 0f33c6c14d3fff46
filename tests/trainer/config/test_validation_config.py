"""The validation / sample-dump config keys: defaults, checks before Ray, and val_kwargs as the rollout reads them."""

import pytest

from scaletrain.trainer.config.ppo_config import load_ppo_config
from scaletrain.utils.typed_config import ConfigError
from tests.trainer.config.test_ppo_config import checked, composed


def test_defaults_are_off_and_val_kwargs_greedy():
    cfg = checked()
    assert (cfg.trainer.rollout_data_dir, cfg.trainer.validation_data_dir, cfg.trainer.log_val_generations) == (
        None,
        None,
        0,
    )
    assert cfg.actor_rollout_ref.rollout.val_sampling() == {"temperature": 0.0, "n": 1}


def test_val_kwargs_sampling_and_do_sample():
    rollout = load_ppo_config(
        composed(
            "actor_rollout_ref.rollout.val_kwargs.n=4",
            "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
            "+actor_rollout_ref.rollout.val_kwargs.top_p=0.9",
        )
    ).actor_rollout_ref.rollout
    assert rollout.val_sampling() == {"temperature": 1.0, "n": 4, "top_p": 0.9}
    rollout.val_kwargs["do_sample"] = False  # verl's switch: greedy whatever the temperature
    assert rollout.val_sampling() == {"temperature": 0.0, "n": 4, "top_p": 0.9}


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.log_val_generations=-1"], "trainer.log_val_generations must be >= 0, got -1"),
        (
            ["+actor_rollout_ref.rollout.val_kwargs.best_of=2"],
            "val_kwargs: unknown key(s) best_of; known: n, temperature",
        ),
        (["actor_rollout_ref.rollout.val_kwargs.n=0"], "actor_rollout_ref.rollout.val_kwargs.n must be a positive int"),
        (["+actor_rollout_ref.rollout.val_kwargs.do_sample=maybe"], "val_kwargs.do_sample must be true or false"),
    ],
)
def test_bad_keys_are_named(overrides, message):
    with pytest.raises(ConfigError) as info:
        checked(*overrides)
    assert message in str(info.value)


def test_dump_dirs_must_be_creatable(tmp_path):
    (tmp_path / "file").write_text("")
    ok = checked(f"trainer.rollout_data_dir={tmp_path / 'new' / 'dir'}")
    assert ok.trainer.rollout_data_dir == str(tmp_path / "new" / "dir") and not (tmp_path / "new").exists()
    with pytest.raises(ConfigError, match=r"trainer.validation_data_dir: .*/file is not a directory"):
        checked(f"trainer.validation_data_dir={tmp_path / 'file' / 'sub'}")
