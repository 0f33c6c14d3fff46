"""A worker's exception and a worker's death both surface in the driver, naming role, rank and method."""

import os
import signal
import threading
import time

import pytest

from scaletrain.controller import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from tests.controller.workers import BrokenInit, EchoWorker, started_group

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def group(ray_cluster):
    with started_group(ray_cluster, 2, EchoWorker, use_gpu=False, name_prefix="actor", call_timeout_s=60) as wg:
        yield wg


def test_remote_exception_names_role_rank_method_and_traceback(group):
    with pytest.raises(WorkerError) as info:
        group.fail_on(1)
    msg = str(info.value)
    assert "worker 'actor' rank 1 failed in fail_on()" in msg
    assert "KeyError: 'boom on rank 1'" in msg and 'workers.py", line' in msg and "\x1b[" not in msg
    assert (info.value.role, info.value.rank, info.value.method) == ("actor", 1, "fail_on")
    assert group.fail_on(5) == [0, 1]  # the group still works afterwards


def test_failure_is_reported_while_peers_still_run(group):
    """Rank 1 fails at once while rank 0 sleeps: the call must not wait for rank 0."""
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1"):
        group.fail_or_sleep(1, 30.0)
    assert time.monotonic() - start < 15


def test_call_timeout_names_the_late_ranks_and_dumps_their_stacks(ray_cluster, tmp_path):
    dump = tmp_path / "stacks"
    with started_group(
        ray_cluster, 2, EchoWorker, use_gpu=False, name_prefix="slow", call_timeout_s=1.0, stack_dump_dir=str(dump)
    ) as wg:
        with pytest.raises(WorkerTimeoutError, match=r"sleep\(\) did not finish on ranks \[0, 1\]") as info:
            wg.sleep(20)
        assert str(dump) in str(info.value) and info.value.ranks == [0, 1]
        for rank, worker in enumerate(wg.worker_infos):
            text = (dump / f"slow-rank{rank}-pid{worker['pid']}.txt").read_text()
            assert "in sleep" in text and "workers.py" in text, text  # the frame the worker is stuck in


def test_killed_worker_fails_pending_call_naming_it(ray_cluster):
    with started_group(ray_cluster, 2, EchoWorker, use_gpu=False, name_prefix="victim") as wg:
        victim_pid = wg.worker_infos[1]["pid"]
        killer = threading.Timer(2.0, os.kill, args=(victim_pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        try:
            with pytest.raises(WorkerDiedError) as info:
                wg.sleep(120)  # would take 2 minutes; the kill must end it early
        finally:
            killer.cancel()
        assert time.monotonic() - start < 60
        assert info.value.rank == 1 and info.value.role == "victim"
        assert f"pid {victim_pid}" in str(info.value) and "sleep()" in str(info.value)


def test_constructor_failure_names_rank(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False)
    with pytest.raises(WorkerError) as info:
        RayWorkerGroup(pool, RayClassWithInitArgs(BrokenInit), name_prefix="broken")
    assert info.value.rank == 1
    assert "cannot build the model on rank 1" in str(info.value)
    pool.release()
