"""Reward functions the reward tests load by path (like a user's custom_reward_function file)."""

import os
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Exact match, with the response length as an extra metric."""
    return {"score": float(solution_str.strip() == str(ground_truth)), "resp_chars": len(solution_str)}


def misbehaving(data_source, solution_str, ground_truth, extra_info=None):
    """ground_truth picks the failure: "hang" sleeps (almost) forever, "slow" takes 2 s, "boom" raises, "die" kills
    the worker, "nan" returns NaN, "text" returns a string; otherwise exact match."""
    if ground_truth == "hang":
        time.sleep(3600)
    if ground_truth == "slow":
        time.sleep(2)
        return 1.0
    if ground_truth == "boom":
        raise RuntimeError("scorer exploded")
    if ground_truth == "die":
        os._exit(3)
    if ground_truth == "nan":
        return float("nan")
    if ground_truth == "text":
        return "not a number"
    return float(solution_str.strip() == str(ground_truth))


def hang_with_child(pid_file):
    """Starts a grandchild process, records its pid, then hangs."""
    import subprocess

    child = subprocess.Popen(["sleep", "3600"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    time.sleep(3600)


def batch_exact(data_sources, solution_strs, ground_truths, extra_infos):
    """Batch scorer; a ground truth "hang" in the batch hangs the whole call, "short" returns too few values."""
    if "hang" in ground_truths:
        time.sleep(3600)
    if "short" in ground_truths:
        return [0.0]
    return [float(s.strip() == str(g)) for s, g in zip(solution_strs, ground_truths)]


def always_one(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0


def scaled(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return scale * float(solution_str.strip() == str(ground_truth))


NOT_CALLABLE = 42
