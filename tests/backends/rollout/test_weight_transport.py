"""Weights into an engine in another process (backends/rollout/ipc_transport.py), probed from outside: /dev/shm is
watched by a thread while the agent loops' AsyncLLM engine takes a sync, the engine's greedy tokens are compared with
a fresh engine started from the same weights on disk, and the sender's and the engine's failures are provoked."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from backends.rollout.base import CheckpointEngineSettings
from tests.backends.rollout.test_rollout_vllm import GREEDY, assert_same_rollout, state_dict_buckets
from tests.backends.rollout.test_rollout_vllm_async import engine_children, running

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

SHM = "/dev/shm"


class ShmWatch:
    """The most bytes that files created in /dev/shm after ``start`` held at once (any name: the probe does not
    trust the transport's own file names), sampled every millisecond or so by a thread."""

    def __init__(self) -> None:
        self.before = set(os.listdir(SHM))
        self.peak, self.files = 0, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            held = 0
            for name in set(os.listdir(SHM)) - self.before:
                self.files.add(name)
                held += _bytes_under(os.path.join(SHM, name))
            self.peak = max(self.peak, held)
            time.sleep(0.001)

    def __enter__(self) -> ShmWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _bytes_under(path: str) -> int:
    """The pages really held by a file, or by every file under a directory (0 once gone)."""
    try:
        if not os.path.isdir(path):
            return os.stat(path).st_blocks * 512
        held = 0
        for folder, _, names in os.walk(path):
            for name in names:
                held += _bytes_under(os.path.join(folder, name))
        return held
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def trained(rollout_model_dir, tmp_path_factory):
    """(directory, model): the rollout model with every weight moved (a trained policy), saved as a checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(rollout_model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=generator))
    path = str(tmp_path_factory.mktemp("trained"))
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def engine(rollout_config, rollout_tokenizer):
    from backends.rollout.vllm_async import VLLMAsyncRolloutEngine

    engine = VLLMAsyncRolloutEngine(rollout_config, rollout_tokenizer)
    yield engine
    engine.close()


def sized_buckets(model, parts: int = 8):
    """The model's tensors in buckets of about 1/parts of it (or its largest tensor); (buckets, bucket bytes)."""
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    bucket_bytes = max(max(sizes), sum(sizes) // parts)
    return state_dict_buckets(model, bucket_bytes), bucket_bytes


def using(engine, backend: str):
    engine.config = replace(engine.config, checkpoint_engine=CheckpointEngineSettings(backend=backend))


def test_a_sync_holds_at_most_two_buckets_in_dev_shm_and_equals_a_fresh_engine(
    engine, trained, rollout_config, rollout_tokenizer, prompts
):
    from backends.rollout.vllm_async import VLLMAsyncRolloutEngine

    path, model = trained
    buckets, bucket_bytes = sized_buckets(model)
    total = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
    assert len(buckets) >= 6
    using(engine, "auto")
    with ShmWatch() as watch:
        engine.update_weights(buckets)
    # two slots, each the largest bucket (tensors aligned to 64 bytes); the probe saw them
    bound = 2 * (bucket_bytes + 64 * max(len(b) for b in buckets))
    assert 0 < watch.peak <= bound, (watch.peak, bound, total)
    synced = engine.generate(prompts, GREEDY)
    fresh = VLLMAsyncRolloutEngine(replace(rollout_config, model_path=path), rollout_tokenizer)
    try:
        want = fresh.generate(prompts, GREEDY)
    finally:
        fresh.close()
    assert_same_rollout(synced, want, atol=1e-5)

    using(engine, "naive")  # the former path: every bucket a file before the one call, a whole model copy
    try:
        with ShmWatch() as naive:
            engine.update_weights(buckets)
    finally:
        using(engine, "auto")
    assert naive.peak >= 0.9 * total > bound, (naive.peak, total, bound)
    assert_same_rollout(engine.generate(prompts, GREEDY), want, atol=1e-5)


def test_the_slots_are_reused_by_every_sync(engine, trained):
    _, model = trained
    buckets, _ = sized_buckets(model)
    using(engine, "shm")
    mine = f"scaletrain-sync-{os.getpid()}-"
    engine.update_weights(buckets)
    first = sorted(n for n in os.listdir(SHM) if n.startswith(mine))
    with ShmWatch() as watch:
        engine.update_weights(buckets)
    assert len(first) == 2 and sorted(n for n in os.listdir(SHM) if n.startswith(mine)) == first
    assert not watch.files, f"a sync after the first made files in /dev/shm: {watch.files}"


def test_slot_files_of_dead_owners_are_removed(tmp_path):
    from backends.rollout.ipc_transport import PREFIX, SlotSender

    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    orphan, live, other = (
        tmp_path / f"{PREFIX}{dead}-1-0-1",
        tmp_path / f"{PREFIX}{os.getpid()}-2-0-1",
        tmp_path / "x",
    )
    for f in (orphan, live, other):
        f.write_bytes(b"w" * 4096)
    sender = SlotSender(folder=str(tmp_path))
    assert not orphan.exists() and live.exists() and other.exists()
    sender.close()


def test_a_bad_name_fails_naming_it_and_a_full_sync_recovers(engine, trained, prompts):
    _, model = trained
    buckets, _ = sized_buckets(model)
    using(engine, "shm")
    engine.update_weights(buckets)
    want = engine.generate(prompts, GREEDY)
    bad = [list(b) for b in buckets]
    bad[2] = [*bad[2], ("model.layers.0.mlp.not_a_weight", torch.zeros(3))]
    with pytest.raises(Exception, match="not_a_weight"):
        engine.update_weights(bad)
    engine.update_weights(buckets)
    assert_same_rollout(engine.generate(prompts, GREEDY), want, atol=1e-6)


def test_a_sender_failing_mid_stream_raises_its_error_and_the_engine_recovers(engine, trained, prompts):
    """The trainer's export fails after three buckets (a gather error, say): that error reaches the caller, the
    engine's reload ends instead of waiting for the rest, and a complete sync afterwards serves."""
    _, model = trained
    buckets, _ = sized_buckets(model)
    using(engine, "shm")
    engine.update_weights(buckets)
    want = engine.generate(prompts, GREEDY)

    def failing():
        yield from buckets[:3]
        raise RuntimeError("gather failed on rank 1")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="gather failed on rank 1"):
        engine.update_weights(failing())
    assert time.monotonic() - start < 60
    engine.update_weights(buckets)
    assert_same_rollout(engine.generate(prompts, GREEDY), want, atol=1e-6)


def test_the_engine_process_killed_mid_sync_is_an_error_not_a_hang(rollout_config, rollout_tokenizer, trained):
    from backends.rollout.vllm_async import VLLMAsyncRolloutEngine

    _, model = trained
    buckets, _ = sized_buckets(model)
    before = set(engine_children(os.getpid()))
    victim = VLLMAsyncRolloutEngine(rollout_config, rollout_tokenizer)
    try:
        new = set(engine_children(os.getpid())) - before  # multiprocessing's resource tracker may start too
        (core,) = [p for p in new if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"VLLM::EngineCore")]

        def killing():
            yield from buckets[:2]
            os.kill(core, signal.SIGKILL)
            while running(core):
                time.sleep(0.05)
            yield from buckets[2:]

        start = time.monotonic()
        # the stream's end, or the engine call's own error (vLLM's dead engine) where it settled first
        with pytest.raises(RuntimeError, match="the engine process closed the weight stream mid-update"):
            victim.update_weights(killing())
        assert time.monotonic() - start < 60, "the sync waited on a dead engine"
    finally:
        try:
            victim.close()
        except Exception:
            pass  # its engine core is gone
