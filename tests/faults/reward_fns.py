"""Reward functions the CLI fault tests load by path, as a user's custom_reward_function file: each one a fault."""

import time


def raises_always(data_source, solution_str, ground_truth, extra_info=None, **settings):
    """``settings``: what custom_reward_function.reward_kwargs binds (secrets among them in the fault suite)."""
    raise ValueError(f"scorer bug: cannot parse {solution_str!r}")


def hangs_on_odd_answers(data_source, solution_str, ground_truth, extra_info=None, api_key=None):
    """About half of the embedded task's answers are odd: those samples hang. ``api_key``: a secret the config
    passes (custom_reward_function.reward_kwargs), which must not reach any logger."""
    assert api_key, "the reward kwargs did not arrive"
    if int(ground_truth) % 2:
        time.sleep(3600)
    return float(solution_str.strip() == str(ground_truth))
