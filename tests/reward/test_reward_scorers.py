"""Rule scorers on examples: GSM8K, MATH (math-verify), the arithmetic task, default dispatch, components."""

import pytest

from scaletrain.reward.scorers import arithmetic, gsm8k
from scaletrain.reward.scorers import math as math_scorer
from scaletrain.reward.scorers.components import correctness_score, format_score, length_score
from scaletrain.reward.scorers.default import default_compute_score


@pytest.mark.parametrize(
    "text, method, expected",
    [
        ("48 / 2 = 24 clips.\n#### 72", "strict", "72"),
        ("first #### 5 then #### 1,234", "strict", "1234"),
        ("It costs $18.", "strict", None),
        ("It costs $18.", "flexible", "18"),
        ("2 apples, 3 pears, so -7.5 total", "flexible", "-7.5"),
        ("no numbers here", "flexible", None),
    ],
)
def test_gsm8k_extract(text, method, expected):
    assert gsm8k.extract_answer(text, method) == expected


def test_gsm8k_score():
    assert gsm8k.compute_score("so #### 1,234", "1234") == 1.0
    assert gsm8k.compute_score("so #### 18.00", "18") == 1.0
    assert gsm8k.compute_score("so #### 17", "18") == 0.0
    assert gsm8k.compute_score("so #### 17", "18", format_score=0.1) == 0.1
    assert gsm8k.compute_score("the answer is 18", "18") == 0.0  # strict needs ####
    assert gsm8k.compute_score("the answer is 18", "18", method="flexible") == 1.0
    with pytest.raises(ValueError, match="strict"):
        gsm8k.extract_answer("#### 1", "loose")


def test_math_last_boxed():
    assert math_scorer.last_boxed(r"a \boxed{1} then \boxed{\frac{1}{2}} end") == r"\frac{1}{2}"
    assert math_scorer.last_boxed(r"so $\boxed 5$") == "5"
    assert math_scorer.last_boxed(r"\fbox{x+1}") == "x+1"
    assert math_scorer.last_boxed("no box") is None
    assert math_scorer.last_boxed(r"\boxed{\frac{1}{2}") is None  # cut off


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
        (r"$\boxed{0.5}$", r"\frac{1}{2}", 1.0),
        (r"\boxed{2^{1/2}}", r"\sqrt{2}", 1.0),
        (r"\boxed{3}", r"\frac{6}{2}", 1.0),
        (r"\boxed{4}", "3", 0.0),
        ("the answer is 3", "3", 0.0),  # no boxed answer
        (r"\boxed{10}", r"So the total is $\boxed{10}$.", 1.0),  # ground truth given as a full solution
    ],
)
def test_math_score(response, truth, expected):
    assert math_scorer.compute_score(response, truth) == expected


def test_arithmetic_is_strict():
    assert arithmetic.compute_score("695", "695") == 1.0
    assert arithmetic.compute_score(" 695\n", 695) == 1.0
    assert arithmetic.compute_score("695 ", "695", {"response_ended_with_eos": True}) == 1.0
    assert arithmetic.compute_score("695", "695", {"response_ended_with_eos": False}) == 0.0
    assert arithmetic.compute_score("The answer is 695", "695") == 0.0
    assert arithmetic.compute_score("6950", "695") == 0.0
    assert arithmetic.compute_score("", "695") == 0.0


def test_default_dispatch():
    assert default_compute_score("openai/gsm8k", "#### 72", "72") == 1.0
    assert default_compute_score("lighteval/MATH", r"\boxed{\frac{2}{4}}", r"\frac{1}{2}") == 1.0
    assert default_compute_score("DigitalLearningGmbH/MATH-lighteval", r"\boxed{1}", "2") == 0.0
    assert default_compute_score("scaletrain/arithmetic", "695", "695", {"response_ended_with_eos": True}) == 1.0
    with pytest.raises(NotImplementedError, match="my/unknown_source"):
        default_compute_score("my/unknown_source", "1", "1")


def test_components():
    assert format_score("scaletrain/arithmetic", " -12 ", "x") == 1.0
    assert format_score("scaletrain/arithmetic", "12 apples", "x") == 0.0
    assert format_score("openai/gsm8k", "#### 3", "x") == 1.0
    assert format_score("lighteval/MATH", "#### 3", "x") == 0.0
    assert format_score("other", r"\boxed{3}", "x") == 1.0
    assert correctness_score("openai/gsm8k", "#### 3", "3") == 1.0
    assert length_score("s", "a" * 10, "", target_chars=10) == 1.0
    assert length_score("s", "a" * 15, "", target_chars=10) == 0.5
    assert length_score("s", "a" * 30, "", target_chars=10) == 0.0
