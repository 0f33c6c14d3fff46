"""Fixtures of the fault suite: the reward tests' tokenizer and batch builder (a fault is injected through the same
real stack those tests use)."""

from tests.reward.conftest import make_batch, tokenizer  # noqa: F401 - fixtures, found by name
