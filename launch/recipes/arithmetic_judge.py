"""The embedded default's reward asked of a generative judge (``reward.judge``) instead of computed by its rule: the
judge gets the expected answer and the response and says yes or no, as ``remote_judge_seeds.py``'s stand-in
server does with the rule's verdict. A response cut off before EOS scores 0 without a question (as the rule's); a
reply other than yes / no raises, so the sample counts as a scorer error instead of a silent 0."""

from __future__ import annotations

EOS_KEY = "response_ended_with_eos"  # scaletrain/reward/scorers/arithmetic.py's flag, set by the reward managers


async def compute_score(data_source, solution_str, ground_truth, extra_info=None, judge=None):
    if extra_info is not None and not extra_info.get(EOS_KEY, True):
        return 0.0
    question = f"Is the answer right?\nExpected: {ground_truth}\nAnswer: {solution_str.strip()}"
    reply = (await judge.chat([{"role": "user", "content": question}], max_tokens=2, temperature=0.0)).strip().lower()
    if reply not in ("yes", "no"):
        raise ValueError(f"the judge replied {reply!r}, not yes or no")
    return 1.0 if reply == "yes" else 0.0
