"""Fixtures of the fault suite: the reward tests' tokenizer and batch builder (a fault is injected through the same
real stack those tests use); ``no_sandbox``, a machine without bubblewrap for code_runner."""

import pytest

from scaletrain.agent.tools import sandbox
from tests.reward.conftest import make_batch, tokenizer  # noqa: F401 - fixtures, found by name


@pytest.fixture
def no_sandbox(monkeypatch):
    """bubblewrap looked up under a name that does not exist: the machine has no sandbox for code_runner."""
    monkeypatch.setattr(sandbox, "BWRAP", "scaletrain-no-such-bwrap")
    sandbox.sandbox_problem.cache_clear()
    yield
    monkeypatch.undo()
    sandbox.sandbox_problem.cache_clear()


@pytest.fixture(params=["sandboxed", "unsandboxed"])
def unsandboxed(request) -> bool:
    """A code_runner test both ways: in the sandbox, and where there is none and ``allow_unsandboxed`` forces a run
    (for the attacks, the control: there they must succeed)."""
    if request.param == "unsandboxed":
        request.getfixturevalue("no_sandbox")
    return request.param == "unsandboxed"
