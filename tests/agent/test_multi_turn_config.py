"""The multi_turn config keys: YAML defaults, overrides, and validation errors naming the key (before Ray)."""

import pytest

from scaletrain.trainer.config.ppo_config import load_ppo_config
from scaletrain.utils.typed_config import ConfigError
from tests.trainer.config.test_ppo_config import checked, composed


def test_multi_turn_defaults_and_overrides():
    cfg = checked()
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.mode == "sync" and not rollout.multi_turn.enable and not rollout.use_agent_loop
    cfg = checked(
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_user_turns=3",
        "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=left",
    )
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert cfg.actor_rollout_ref.rollout.use_agent_loop and mt.max_user_turns == 3 and mt.format == "hermes"
    assert load_ppo_config(composed("actor_rollout_ref.rollout.mode=async")).actor_rollout_ref.rollout.use_agent_loop


def test_async_engine_is_the_agent_loops_default_on_vllm_at_tp1():
    def rollout(*overrides):
        return checked(*overrides).actor_rollout_ref.rollout

    assert not rollout("rollout=vllm").use_async_engine  # no agent loops: the batched generate
    assert rollout("rollout=vllm", "actor_rollout_ref.rollout.mode=async").use_async_engine
    assert not rollout("rollout=hf", "actor_rollout_ref.rollout.mode=async").use_async_engine  # hf: the batcher
    off = ("rollout=vllm", "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.async_engine=false")
    assert not rollout(*off).use_async_engine
    with pytest.raises(ConfigError, match="async_engine=true needs the agent loops .* name=hf"):
        checked("rollout=hf", "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.async_engine=true")


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor_rollout_ref.rollout.mode=fast", "actor_rollout_ref.rollout.mode must be sync | async"),
        ("actor_rollout_ref.rollout.multi_turn.format=nope", "multi_turn.format: unknown tool parser 'nope'"),
        (
            "actor_rollout_ref.rollout.multi_turn.default_agent_loop=nope",
            "default_agent_loop: unknown agent loop 'nope'",
        ),
        ("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=top", "left | right | middle"),
        ("actor_rollout_ref.rollout.multi_turn.tools_config_file=/no/tools.yaml", "tools_config_file: not found"),
        ("actor_rollout_ref.rollout.multi_turn.max_parallel_calls=0", "max_parallel_calls must be positive"),
    ],
)
def test_multi_turn_validation(override, message):
    with pytest.raises(ConfigError, match=message.replace("|", "\\|")):
        checked(override)


def test_unknown_multi_turn_key_fails():
    with pytest.raises(ConfigError, match="multi_turn.*nope"):
        load_ppo_config(composed("+actor_rollout_ref.rollout.multi_turn.nope=1"))
