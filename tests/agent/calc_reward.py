"""Reward of the multi-turn calculator e2e test: 1 when the final assistant answer equals the ground truth."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # solution_str is the whole decoded response: tool calls, "<tool>" turns, then the final "<assistant>" answer
    final = solution_str.rsplit("<assistant>", 1)[-1].strip()
    return 1.0 if final == str(ground_truth).strip() else 0.0
