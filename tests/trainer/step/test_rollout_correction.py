"""algorithm.rollout_correction on the driver: mismatch metrics, IS weights and rejection against hand-computed
values, and the config checks (unsupported values and bad thresholds name the key; losses must apply weights)."""

import math

import pytest
import torch

from scaletrain.algos import POLICY_LOSSES
from scaletrain.protocol import DataProto
from scaletrain.trainer.config.ppo_config import RolloutCorrectionConfig
from scaletrain.trainer.step.rollout_correction import apply_rollout_correction, old_log_probs, rs_bounds
from scaletrain.utils.typed_config import ConfigError
from tests.trainer.config.test_ppo_config import checked as checked_config

KEY = "algorithm.rollout_correction"
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
# log pi_train - log pi_rollout per token; the padded cells hold junk that must never count
DELTA = torch.tensor([[0.0, 0.2, -0.05, 9.0], [0.5, 0.0, 3.0, -3.0], [-0.3, 0.0, 0.0, 0.08]])


def make_batch(delta=DELTA):
    old = -torch.rand(MASK.shape, generator=torch.Generator().manual_seed(0)) - 0.5
    return DataProto.from_dict({"old_log_probs": old, "rollout_log_probs": old - delta, "response_mask": MASK.clone()})


def valid_deltas():
    return [DELTA[b, t].item() for b in range(3) for t in range(4) if MASK[b, t]]


def test_identical_log_probs_give_unit_weights_and_zero_mismatch():
    for level in ("token", "sequence"):
        batch = make_batch(torch.zeros_like(DELTA))
        cfg = RolloutCorrectionConfig(rollout_is=level, rollout_rs="token_k1", rollout_rs_threshold="0.999_1.001")
        m = apply_rollout_correction(batch, cfg)
        assert torch.equal(batch.batch["rollout_is_weights"], MASK.float())  # exactly 1 on tokens, 0 on padding
        assert torch.equal(batch.batch["response_mask"], MASK)  # nothing rejected
        for key in (
            "kl_k1",
            "kl_k3",
            "log_prob_abs_diff_mean",
            "log_prob_abs_diff_max",
            "log_prob_abs_diff_above_threshold_frac",
            "is_truncated_frac",
            "rs_masked_frac",
            "rs_seq_masked_frac",
        ):
            assert m[f"rollout_corr/{key}"] == 0.0, key
        assert m["rollout_corr/is_ratio_mean"] == 1.0 and m["rollout_corr/ppl_ratio"] == pytest.approx(1.0)


def test_mismatch_metrics_are_logged_without_correction():
    batch = make_batch()
    m = apply_rollout_correction(batch, RolloutCorrectionConfig(mismatch_log_prob_threshold=0.1))
    d = valid_deltas()
    assert m["rollout_corr/log_prob_abs_diff_mean"] == pytest.approx(sum(abs(x) for x in d) / 9, rel=1e-5)
    assert m["rollout_corr/log_prob_abs_diff_max"] == pytest.approx(0.5, rel=1e-5)
    assert m["rollout_corr/log_prob_abs_diff_above_threshold_frac"] == pytest.approx(3 / 9)  # 0.2, 0.5, 0.3
    assert m["rollout_corr/kl_k1"] == pytest.approx(-sum(d) / 9, rel=1e-5)
    assert m["rollout_corr/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 9, rel=1e-4)
    assert "rollout_is_weights" not in batch.batch.keys() and torch.equal(batch.batch["response_mask"], MASK)
    assert not any(k.startswith("rollout_corr/is_") for k in m)
    no_rollout = DataProto.from_dict({"old_log_probs": torch.zeros(3, 4), "response_mask": MASK.clone()})
    assert apply_rollout_correction(no_rollout, RolloutCorrectionConfig(rollout_is="token")) == {}


def test_bypass_mode_takes_the_rollouts_log_probs_without_the_actor():
    batch = make_batch()
    batch.pop(batch_keys=["old_log_probs"])
    metrics, timings = {}, {}
    # actor None: a forward pass would fail; bypass mode must not make one
    out = old_log_probs(None, batch, RolloutCorrectionConfig(bypass_mode=True), metrics, timings)
    assert torch.equal(out.batch["old_log_probs"], out.batch["rollout_log_probs"]) and metrics == {} == timings
    out.pop(batch_keys=["old_log_probs", "rollout_log_probs"])
    with pytest.raises(ValueError, match=f"{KEY}.bypass_mode=true needs the rollout's log-probs"):
        old_log_probs(None, out, RolloutCorrectionConfig(bypass_mode=True), metrics, timings)


def test_truncated_is_weights_token_and_sequence():
    batch = make_batch()
    m = apply_rollout_correction(batch, RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5))
    expected = torch.where(MASK.bool(), torch.exp(DELTA).clamp(max=1.5), 0.0)  # exp(0.5) = 1.65 -> 1.5
    torch.testing.assert_close(batch.batch["rollout_is_weights"], expected)
    assert m["rollout_corr/is_truncated_frac"] == pytest.approx(1 / 9)

    batch = make_batch()
    apply_rollout_correction(batch, RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=1.5))
    seq = [math.exp(0.15), 1.5, math.exp(-0.22)]  # row 1: exp(0.5) truncated
    for b in range(3):
        for t in range(4):
            assert batch.batch["rollout_is_weights"][b, t].item() == pytest.approx(
                seq[b] if MASK[b, t] else 0.0, rel=1e-5
            )

    batch = make_batch()
    m = apply_rollout_correction(
        batch, RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True)
    )
    factor = expected.sum().item() / 9
    assert m["rollout_corr/is_batch_norm_factor"] == pytest.approx(factor, rel=1e-5)
    torch.testing.assert_close(batch.batch["rollout_is_weights"], expected / factor)


def test_rejection_masks_tokens_or_sequences():
    batch = make_batch()
    m = apply_rollout_correction(batch, RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.3"))
    # ratios exp(0.5) = 1.65 (row 1) and exp(-0.3) = 0.74 (row 2) are out of [0.8, 1.3]; exp(0.2) = 1.22 stays
    assert batch.batch["response_mask"].tolist() == [[1, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1]]
    assert m["rollout_corr/rs_masked_frac"] == pytest.approx(2 / 9)
    assert m["rollout_corr/rs_seq_masked_frac"] == pytest.approx(2 / 3)
    assert "rollout_is_weights" not in batch.batch.keys()

    batch = make_batch()
    m = apply_rollout_correction(batch, RolloutCorrectionConfig(rollout_rs="seq_sum_k1", rollout_rs_threshold=1.3))
    # sequence ratios exp(0.15) = 1.16, exp(0.5) = 1.65, exp(-0.22) = 0.80 against [1 / 1.3 = 0.77, 1.3]
    assert batch.batch["response_mask"].tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert m["rollout_corr/rs_masked_frac"] == pytest.approx(2 / 9)
    assert m["rollout_corr/rs_seq_masked_frac"] == pytest.approx(1 / 3)


def checked(*settings, extra=()):
    """The validated config with ``algorithm.rollout_correction.<setting>`` overrides (plus ``extra``)."""
    return checked_config(*[f"{KEY}.{s}" for s in settings], *extra)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout_is=geometric"], f"{KEY}.rollout_is: unsupported 'geometric'; supported: null, token, sequence"),
        (
            ["rollout_rs=seq_mean_k1", "rollout_rs_threshold=2.0"],
            f"{KEY}.rollout_rs: unsupported 'seq_mean_k1'; supported: null, token_k1, seq_sum_k1",
        ),
        (["rollout_rs=token_k1"], f"{KEY}.rollout_rs=token_k1 needs {KEY}.rollout_rs_threshold"),
        (["rollout_rs=token_k1", "rollout_rs_threshold=1.5_2.0"], f"{KEY}.rollout_rs_threshold: need 0 < lower <= 1"),
        (["rollout_rs=token_k1", "rollout_rs_threshold=0.5"], f"{KEY}.rollout_rs_threshold: need 0 < lower <= 1"),
        (["rollout_rs=token_k1", "rollout_rs_threshold=wide"], f'{KEY}.rollout_rs_threshold: expected "lower_upper"'),
        (["rollout_rs_threshold=2.0"], f"{KEY}.rollout_rs_threshold is set but {KEY}.rollout_rs is null"),
        (["rollout_is=token", "rollout_is_threshold=0.5"], f"{KEY}.rollout_is_threshold must be >= 1"),
        (["rollout_is_batch_normalize=true"], f"{KEY}.rollout_is_batch_normalize needs {KEY}.rollout_is"),
        (["loss_type=reinforce"], f"{KEY}.loss_type=reinforce applies in bypass mode: set {KEY}.bypass_mode=true"),
        (["bypass_mode=true", "loss_type=a2c"], f"{KEY}.loss_type: unsupported 'a2c'; supported: ppo_clip, reinforce"),
        (["mismatch_log_prob_threshold=0"], f"{KEY}.mismatch_log_prob_threshold must be positive"),
    ],
)
def test_bad_keys_are_named(overrides, message):
    with pytest.raises(ConfigError) as info:
        checked(*overrides)
    assert message in str(info.value)


def test_good_keys_and_threshold_forms():
    cfg = checked("rollout_is=sequence", "rollout_rs=token_k1", "rollout_rs_threshold=0.5_2.0").algorithm
    assert cfg.rollout_correction.rollout_is == "sequence"
    assert rs_bounds(cfg.rollout_correction) == (0.5, 2.0)
    assert rs_bounds(RolloutCorrectionConfig(rollout_rs="seq_sum_k1", rollout_rs_threshold=4)) == (0.25, 4.0)
    assert checked().algorithm.rollout_correction == RolloutCorrectionConfig()  # YAML defaults = dataclass defaults
    assert checked("bypass_mode=true").algorithm.rollout_correction.bypass_mode


@pytest.mark.parametrize("loss_mode", POLICY_LOSSES.names())
def test_every_registered_policy_loss_applies_the_weights(loss_mode):
    extra = [f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}"]
    if loss_mode == "bypass_mode":  # the trainer's bypass picks it; it computes its weights itself
        with pytest.raises(ConfigError, match=f"set {KEY}.bypass_mode=true instead"):
            checked("rollout_is=token", extra=extra)
        return
    if loss_mode == "dro":  # the one loss with a setting that has no default
        with pytest.raises(ConfigError, match="dro_beta"):
            checked("rollout_is=token", extra=extra)
        extra.append("actor_rollout_ref.actor.policy_loss.dro_beta=0.1")
    checked("rollout_is=token", extra=extra)


def test_a_loss_that_ignores_or_refuses_the_weights_fails_validation(monkeypatch):
    def ignores(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, **kwargs):
        return (-advantages * log_prob * response_mask).mean(), {}

    def refuses(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config):
        return (-advantages * log_prob * response_mask).mean(), {}

    for name, fn, message in (
        ("ignores_w", ignores, "ignores rollout_is_weights"),
        ("refuses_w", refuses, "takes no rollout_is_weights"),
    ):
        monkeypatch.setitem(POLICY_LOSSES._entries, name, fn)
        loss_mode = f"actor_rollout_ref.actor.policy_loss.loss_mode={name}"
        with pytest.raises(ConfigError, match=message):
            checked("rollout_is=token", extra=[loss_mode])
        checked(extra=[loss_mode])  # without IS weights any loss will do


def test_a_bypass_that_corrects_trains_with_the_bypass_mode_loss():
    from scaletrain.trainer.config.plan import plan_run, resolve_config
    from scaletrain.trainer.config.worker_configs import ppo_worker_configs

    def actor_of(cfg):
        cfg = resolve_config(cfg)
        return ppo_worker_configs(cfg, plan_run(cfg, 1024, None))[0][0].actor

    cfg = checked(
        "bypass_mode=true",
        "loss_type=reinforce",
        "rollout_is=sequence",
        "rollout_rs=token_k1",
        "rollout_rs_threshold=0.5_2.0",
    )
    actor = actor_of(cfg)
    assert actor.policy_loss.loss_mode == "bypass_mode"
    assert actor.policy_loss.rollout_correction == {
        "loss_type": "reinforce",
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_is_batch_normalize": False,
        "rollout_rs": "token_k1",
        "rollout_rs_threshold": "0.5_2.0",
    }
    plain = checked("bypass_mode=true")  # nothing to correct: PPO against the rollout, the configured loss
    assert actor_of(plain).policy_loss.loss_mode == "vanilla"
    with pytest.raises(ConfigError, match="not actor_rollout_ref.actor.policy_loss.loss_mode=gspo"):
        checked("bypass_mode=true", "rollout_is=token", extra=["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])
