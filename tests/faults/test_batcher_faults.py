"""The agent loops' batcher cannot strand a trajectory: when the batcher itself fails, every waiting trajectory
gets its error (before: the batcher task died and the trajectories waited forever)."""

import asyncio

import pytest

from backends.rollout.base import TokenOutput
from scaletrain.agent.server import AsyncServerManager, LocalEngineBackend


class ShortEngine:
    """Returns one output fewer than it was asked for: a broken engine the batcher cannot map back."""

    def generate_tokens(self, requests):
        return [TokenOutput([1], [-0.1], "stop") for _ in requests[1:]]


class RaisingEngine:
    def generate_tokens(self, requests):
        raise RuntimeError("engine exploded")


async def _three_trajectories(server):
    calls = [server.generate(f"t{i}", [5, 6, 7], {"temperature": 1.0}) for i in range(3)]
    try:
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=20)
    finally:
        await server.close()


def test_batcher_failure_reaches_every_waiting_trajectory():
    server = AsyncServerManager(LocalEngineBackend([ShortEngine()]), max_wait_ms=50)
    results = asyncio.run(_three_trajectories(server))
    assert len(results) == 3
    for result in results:
        assert isinstance(result, RuntimeError), result
        assert "rollout engines returned [2] outputs per rank for [3]" in str(result)


def test_engine_error_reaches_every_trajectory_and_the_batcher_goes_on():
    server = AsyncServerManager(LocalEngineBackend([RaisingEngine()]), max_wait_ms=50)
    results = asyncio.run(_three_trajectories(server))
    assert [str(r) for r in results] == ["engine exploded"] * 3


def test_closing_the_batcher_fails_waiting_trajectories():
    class Hang:
        def generate_tokens(self, requests):
            import time

            time.sleep(2)
            return [TokenOutput([1], [-0.1], "stop") for _ in requests]

    async def run():
        server = AsyncServerManager(LocalEngineBackend([Hang()]), max_wait_ms=10)
        task = asyncio.ensure_future(server.generate("t0", [5], {"temperature": 1.0}))
        await asyncio.sleep(0.3)
        await server.close()
        with pytest.raises(RuntimeError, match="the rollout batcher stopped"):
            await asyncio.wait_for(task, timeout=5)

    asyncio.run(run())
