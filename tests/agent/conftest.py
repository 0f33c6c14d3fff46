"""Fixtures of the agent tests: the warmed-up tool-calling tiny model (built once per session)."""

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> str:
    from tests.agent.warmup import build_tool_model

    return build_tool_model(str(tmp_path_factory.mktemp("tool_model")), steps=150)
