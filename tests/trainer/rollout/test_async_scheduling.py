"""Asynchronous training's scheduling and plumbing, without workers.

- ``FullyAsyncRollouts`` / ``OneStepOffRollouts`` driven as ``fit()`` drives them (next, after_update, data_state,
  close) by a plain-Python fake trainer whose rollout engine stamps each batch with its weight version: the
  staleness bound (and that it is reached), loader order and step numbers, the sync schedule of (0, 1), the
  ``max_batches`` bound, resumable data state, errors surfacing from ``next()``, one-step-off's push timing.
- ``validate_async_training``'s ConfigErrors, ``resolve_config``'s fully_async batch size and ``plan_run``'s
  ``rollout.total_rollout_steps``.
- ``weight_transport``: buckets through Ray's object store round-trip exactly.
"""

import copy
import math
import random
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from scaletrain.data.loader import StatefulDataLoader
from scaletrain.protocol import DataProto
from scaletrain.trainer.config.async_checks import validate_async_training
from scaletrain.trainer.config.plan import plan_run, resolve_config
from scaletrain.trainer.config.ppo_config import AsyncTrainingConfig, load_ppo_config
from scaletrain.trainer.rollout.dynamic_sampling import Scored
from scaletrain.trainer.rollout.fully_async import FullyAsyncRollouts
from scaletrain.trainer.rollout.schedules import OneStepOffRollouts, next_batch
from scaletrain.utils.typed_config import ConfigError

pytestmark = pytest.mark.timeout(60)

ROWS, BATCH = 14, 3  # 4 batches an epoch (2 rows dropped): the runs below cross epochs


def make_loader() -> StatefulDataLoader:
    collate = lambda rows: DataProto.from_dict(non_tensors={"row": np.array(rows, dtype=np.int64)})  # noqa: E731
    return StatefulDataLoader(list(range(ROWS)), BATCH, shuffle=True, seed=5, collate_fn=collate)


def rows_of(batch: DataProto) -> list[int]:
    return [int(r) for r in batch.non_tensor_batch["row"]]


class FakeWeightSync:
    def __init__(self, version: int, log: list) -> None:
        self.version, self.log = version, log

    def push(self) -> dict[str, float]:
        self.version += 1
        self.log.append(("push", self.version))
        return {"async/weight_version": float(self.version)}


class FakeTrainer:
    """fit()'s state (the step, the loader, the weight sync) and a fake rollout producer (``scored``) whose engine
    stamps each batch with its weight version; ``log`` records generations and pushes in order."""

    def __init__(self, staleness=0.0, sync_every=1, total_steps=12, start=0, fail_step=None, mode="fully_async"):
        at = AsyncTrainingConfig(mode=mode, staleness_threshold=staleness, trigger_parameter_sync_step=sync_every)
        self.cfg = SimpleNamespace(async_training=at)
        self.global_step, self.total_steps = start, total_steps
        self.loader = make_loader()
        for _ in range(start):  # a resumed run's loader sits after the trained batches
            next_batch(self.loader)
        self.log: list = []
        self.weight_sync = FakeWeightSync(start, self.log)  # resumed runs carry their version
        self.fail_step = fail_step
        self.rng = random.Random(0)

    def scored(self, batch: DataProto, step: int, gen_index: int, timings: dict) -> Scored:
        version = self.weight_sync.version
        self.log.append(("gen", step, version))
        time.sleep(self.rng.uniform(0, 0.002))
        if step == self.fail_step:
            raise ValueError(f"engine died at step {step}")
        n = len(batch)
        batch.non_tensor_batch["rollout_version"] = np.full(n, version, dtype=np.int64)
        batch.non_tensor_batch["gen_step"] = np.full(n, step, dtype=np.int64)
        return Scored(batch, {}, {})

    def gens(self) -> list:
        return [e for e in self.log if e[0] == "gen"]


def fully_async(trainer: FakeTrainer, max_batches: int) -> FullyAsyncRollouts:
    """The schedule as fit() builds it: over the producer, the loader and the weight sync, from the next step."""
    at = trainer.cfg.async_training
    return FullyAsyncRollouts(trainer, trainer.loader, trainer.weight_sync, at, trainer.global_step + 1, max_batches)


def one_step_off(trainer: FakeTrainer) -> OneStepOffRollouts:
    return OneStepOffRollouts(trainer, trainer.loader, trainer.weight_sync, trainer.total_steps)


def expected_rows(start: int, n: int) -> list[list[int]]:
    """The rows of batches start+1 .. start+n of an uninterrupted loader."""
    ref = make_loader()
    return [rows_of(next_batch(ref)) for _ in range(start + n)][start:]


def drive(src, trainer, train_s=0.0, validate_every=0, warmup=0) -> list[dict]:
    """fit()'s loop: next, train (sleep), after_update (not during a critic warm-up), validation, checkpoint."""
    trained = []
    while trainer.global_step < trainer.total_steps:
        timings: dict = {}
        scored = src.next(trainer.global_step + 1, timings)
        if scored is None:
            break
        trainer.global_step += 1
        nt = scored.batch.non_tensor_batch
        rec = {
            "step": trainer.global_step,
            "gen_step": int(nt["gen_step"][0]),
            "rows": rows_of(scored.batch),
            "staleness": trainer.weight_sync.version - int(nt["rollout_version"][0]),
            "pushes_before": trainer.weight_sync.version,
            "metrics": scored.metrics,
        }
        time.sleep(train_s)
        src.after_update(timings, trainer.global_step > warmup)
        if validate_every and trainer.global_step % validate_every == 0:
            src.before_validation(trainer.global_step == trainer.total_steps)
        rec["data_state"] = copy.deepcopy(src.data_state())
        trained.append(rec)
    return trained


def earliest_push(b: int, s: float, k: int) -> int:
    """The fewest pushes after which batch b (0-based) may start: b < floor((P + 1 + s) * k)."""
    return next(p for p in range(b + 1) if b < math.floor((p + 1 + s) * k + 1e-9))


def check_resume_points(trained: list[dict], start: int) -> None:
    """data_state() after k trained batches, in a fresh loader, yields batch k + 1."""
    want = expected_rows(start, len(trained) + 1)
    for k, rec in enumerate(trained):
        fresh = make_loader()
        fresh.load_state_dict(rec["data_state"])
        assert rows_of(next_batch(fresh)) == want[k + 1], f"resume point after step {rec['step']}"


PAIRS = [(0.0, 1, 0), (0.0, 2, 3), (1.0, 1, 0), (0.5, 2, 2), (2.0, 3, 0)]  # (staleness, sync every, start step)


@pytest.mark.parametrize("slow", [True, False], ids=["slow_trainer", "fast_trainer"])
@pytest.mark.parametrize("staleness,sync_every,start", PAIRS)
def test_fully_async_bounds_staleness_in_loader_order(staleness, sync_every, start, slow):
    trainer = FakeTrainer(staleness, sync_every, total_steps=start + 12, start=start)
    src = fully_async(trainer, 12)
    try:
        trained = drive(src, trainer, train_s=0.03 if slow else 0.0)
        assert src.next(trainer.global_step + 1, {}) is None and src.next(trainer.global_step + 1, {}) is None
    finally:
        src.close()
    bound = math.ceil(staleness)
    assert [r["step"] for r in trained] == [r["gen_step"] for r in trained] == list(range(start + 1, start + 13))
    assert [r["rows"] for r in trained] == expected_rows(start, 12)
    for b, rec in enumerate(trained):
        assert rec["pushes_before"] - start == b // sync_every, "a push every trigger_parameter_sync_step steps"
        assert 0 <= rec["staleness"] <= bound, rec
        assert rec["metrics"]["async/staleness_max"] == rec["staleness"]
    gens = trainer.gens()
    assert [g[1] for g in gens] == list(range(start + 1, start + 13)), "each batch generated once, in order"
    for b, (_, _, version) in enumerate(gens):  # never ahead of the window the pushes so far allow
        assert version - start >= earliest_push(b, staleness, sync_every), (b, version)
    if slow:  # the rollouter always waits on the window: the bound is reached, and exactly
        assert [v - start for _, _, v in gens] == [earliest_push(b, staleness, sync_every) for b in range(12)]
        assert max(r["staleness"] for r in trained) == bound
    check_resume_points(trained, start)


def test_fully_async_with_no_lag_is_the_sync_schedule():
    trainer = FakeTrainer(0.0, 1, total_steps=6)
    src = fully_async(trainer, 6)
    try:
        trained = drive(src, trainer)
    finally:
        src.close()
    assert [r["staleness"] for r in trained] == [0] * 6
    # each batch is generated only after the previous batch's update was pushed
    assert trainer.log == [e for i in range(6) for e in (("gen", i + 1, i), ("push", i + 1))]


def test_fully_async_generates_at_most_max_batches():
    trainer = FakeTrainer(2.0, 3, total_steps=10)  # a window of 9 batches, but only 4 allowed
    src = fully_async(trainer, 4)
    try:
        src.thread.join(timeout=5)
        assert not src.thread.is_alive(), "the rollouter stops by itself after max_batches"
        assert [g[1] for g in trainer.gens()] == [1, 2, 3, 4]
        trained = drive(src, trainer, train_s=0.005)
        assert [r["step"] for r in trained] == [1, 2, 3, 4] and trainer.global_step == 4
        assert src.next(5, {}) is None
    finally:
        src.close()
    check_resume_points(trained, 0)


@pytest.mark.timeout(20)
def test_fully_async_rollout_error_surfaces_from_next():
    trainer = FakeTrainer(0.0, 1, total_steps=6, fail_step=3)
    src = fully_async(trainer, 6)
    try:
        with pytest.raises(RuntimeError, match="rollouter failed: engine died at step 3") as info:
            drive(src, trainer)
        assert isinstance(info.value.__cause__, ValueError) and trainer.global_step == 2
    finally:
        src.close()


def test_fully_async_validation_pushes_only_after_the_last_step():
    trainer = FakeTrainer(0.0, 2, total_steps=3)
    src = fully_async(trainer, 3)
    try:
        assert src.before_validation(False) == {} and trainer.weight_sync.version == 0
        drive(src, trainer, validate_every=2)  # the validation after step 2 falls on its push: no extra one
        assert trainer.weight_sync.version == 1, "step 3's update is not pushed yet"
        assert src.before_validation(False) == {}, "mid-run, an extra push would loosen the staleness bound"
        assert src.before_validation(True) == {"async/weight_version": 2.0} and src.before_validation(True) == {}
    finally:
        src.close()


def test_fully_async_bound_holds_with_validation_between_syncs():
    trainer = FakeTrainer(0.0, 2, total_steps=8)
    src = fully_async(trainer, 8)
    try:
        trained = drive(src, trainer, train_s=0.02, validate_every=3)  # test_freq=3, trigger_parameter_sync_step=2
    finally:
        src.close()
    assert [r["staleness"] for r in trained] == [0] * 8


def test_fully_async_survives_a_critic_warmup():
    trainer = FakeTrainer(0.0, 1, total_steps=4)
    src = fully_async(trainer, 4)
    out: list = []
    fit = threading.Thread(target=lambda: out.append(drive(src, trainer, warmup=2)), daemon=True)
    fit.start()
    fit.join(timeout=1.5)
    hung = fit.is_alive()
    src.close()  # unblocks the trainer's next() (it then sees None)
    fit.join(timeout=3)
    assert not hung and trainer.global_step == 4


def test_one_step_off_lags_one_version_and_pushes_between_batches():
    trainer = FakeTrainer(mode="one_step_off", total_steps=6)
    src = one_step_off(trainer)
    try:
        trained = drive(src, trainer, train_s=0.005)
    finally:
        src.close()
    assert [r["staleness"] for r in trained] == [0, 1, 1, 1, 1, 1]
    assert [r["step"] for r in trained] == [r["gen_step"] for r in trained] == [1, 2, 3, 4, 5, 6]
    assert [r["rows"] for r in trained] == expected_rows(0, 6)
    # step k+1's rollout starts before step k's update; step k's weights go out when step k+1's batch is taken
    want = [("gen", 1, 0), ("gen", 2, 0)]
    for k in range(1, 5):
        want += [("push", k), ("gen", k + 2, k)]
    assert trainer.log == [*want, ("push", 5)]
    assert "async/trainer_idle_s" in trained[0]["metrics"] and trained[-1]["metrics"]["async/staleness_max"] == 1
    check_resume_points(trained, 0)


def test_one_step_off_data_state_excludes_the_batch_in_flight():
    trainer = FakeTrainer(mode="one_step_off", total_steps=5)
    src = one_step_off(trainer)
    try:
        for step in range(1, 4):
            src.next(step, {})
            src.after_update({})
            consumed, drawn = src.data_state(), trainer.loader.state_dict()
            assert (consumed["epoch"], consumed["batches_in_epoch"]) == divmod(step, 4)
            assert (drawn["epoch"], drawn["batches_in_epoch"]) == divmod(step + 1, 4), "batch k+1 already drawn"
    finally:
        src.close()


def test_one_step_off_before_validation_pushes_only_after_an_update():
    trainer = FakeTrainer(mode="one_step_off", total_steps=4)
    src = one_step_off(trainer)
    try:
        assert src.before_validation(False) == {}
        src.next(1, {})
        assert src.before_validation(False) == {} and trainer.weight_sync.version == 0
        src.after_update({})
        assert src.before_validation(False) == {"async/weight_version": 1.0} and src.before_validation(False) == {}
        src.next(2, {})  # already pushed: the step does not push again
        assert trainer.weight_sync.version == 1
    finally:
        src.close()


@pytest.mark.timeout(20)
def test_one_step_off_rollout_error_surfaces_from_next():
    trainer = FakeTrainer(mode="one_step_off", total_steps=5, fail_step=3)
    src = one_step_off(trainer)
    try:
        with pytest.raises(ValueError, match="engine died at step 3"):
            drive(src, trainer)
        assert trainer.global_step == 2
    finally:
        src.close()


# ------------------------------------------------------------------------------------------------ config
SPLIT = {"actor_rollout_ref": {"hybrid_engine": False}}


def config(*overrides: dict, **async_training):
    merged: dict = {"async_training": dict(async_training)}
    for override in overrides:
        for section, values in override.items():
            node = merged.setdefault(section, {})
            for key, value in values.items():
                if isinstance(value, dict):
                    node.setdefault(key, {}).update(value)
                else:
                    node[key] = value
    return load_ppo_config(merged)


FULLY = {"data": {"train_batch_size": 256}}  # = actor.ppo_mini_batch_size's default
BAD = [
    (config(mode="one_step_off"), "actor_rollout_ref.hybrid_engine=false"),
    (config(SPLIT, mode="eventually"), "async_training.mode must be one of"),
    (config(mode="sync", staleness_threshold=0.5), "async_training.staleness_threshold"),
    (config(SPLIT, FULLY, mode="fully_async", trigger_parameter_sync_step=0), "trigger_parameter_sync_step must be"),
    (config(SPLIT, FULLY, mode="fully_async", partial_rollout=True), "actor_rollout_ref.rollout.mode=async"),
    (config(SPLIT, mode="fully_async"), "data.train_batch_size"),
    (config(SPLIT, {"algorithm": {"filter_groups": {"enable": True}}}, mode="one_step_off"), "filter_groups.enable"),
    (config({"actor_rollout_ref": {"hybrid_engine": False, "rollout": {"nnodes": 0}}}), "rollout.nnodes"),
    (config(SPLIT, FULLY, mode="fully_async", staleness_threshold=-1), "staleness_threshold must be >= 0"),
    (config({"actor_rollout_ref": {"rollout": {"total_rollout_steps": 512}}}), "total_rollout_steps"),
]


@pytest.mark.parametrize("cfg,message", BAD)
def test_invalid_async_configs_name_the_key(cfg, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate_async_training(cfg)


ASYNC_ROLLOUT = {"actor_rollout_ref": {"hybrid_engine": False, "rollout": {"mode": "async"}}}


@pytest.mark.parametrize(
    "cfg",
    [
        config(),
        config(SPLIT),
        config(SPLIT, mode="one_step_off"),
        config(SPLIT, FULLY, mode="fully_async", staleness_threshold=0.5, trigger_parameter_sync_step=4),
        config(ASYNC_ROLLOUT, FULLY, mode="fully_async", partial_rollout=True, partial_rollout_segment_tokens=64),
    ],
)
def test_valid_async_configs_pass(cfg):
    validate_async_training(cfg)


def test_resolve_and_plan_size_fully_async_runs(tmp_path):
    small = {
        "data": {"train_batch_size": 0},
        "actor_rollout_ref": {"hybrid_engine": False, "actor": {"ppo_mini_batch_size": 4, "ppo_epochs": 2}},
        "trainer": {"default_local_dir": str(tmp_path), "total_epochs": 2},
    }
    assert resolve_config(config(small, mode="sync")).data.train_batch_size == 0, "only fully_async fills it"
    cfg = resolve_config(config(small, mode="fully_async"))
    assert cfg.data.train_batch_size == 4
    validate_async_training(cfg)
    plan = plan_run(cfg, 100, None)
    assert (plan.steps_per_epoch, plan.total_steps, plan.rollout_batches) == (25, 50, 50)
    assert plan.actor_optim_steps == 100 and plan.rollout_world_size == 1 and plan.resume_path is None
    cases = [(None, 40, 10, 10), (5, 40, 5, 10), (20, 40, 10, 10), (7, None, 7, 7)]
    for steps, prompts, total, batches in cases:
        over = {"trainer": {"total_training_steps": steps}, "actor_rollout_ref": {"rollout": {}}}
        over["actor_rollout_ref"]["rollout"]["total_rollout_steps"] = prompts
        plan = plan_run(resolve_config(config(small, over, mode="fully_async")), 100, None)
        assert (plan.total_steps, plan.rollout_batches) == (total, batches), (steps, prompts)


# ------------------------------------------------------------------------------------------ weight transport
def test_weight_buckets_round_trip_exactly(ray_cluster):
    from scaletrain.controller.weight_transport import put_buckets, read_buckets

    g = torch.Generator().manual_seed(0)
    buckets = [
        [
            ("w.f32", torch.randn(3, 5, generator=g)),
            ("w.bf16", torch.randn(4, 2, generator=g).to(torch.bfloat16)),
            ("w.t", torch.randn(2, 6, generator=g).t()),  # not contiguous
        ],
        [("ids.i64", torch.arange(-3, 9, dtype=torch.int64).reshape(3, 4)), ("scale", torch.tensor(2.5))],
        [("step", torch.tensor(7, dtype=torch.int64))],
    ]
    sent = put_buckets(iter(buckets), version=7)
    assert sent.version == 7 and len(sent.refs) == 3
    assert sent.nbytes == sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)
    got = list(read_buckets(sent))
    assert [[n for n, _ in b] for b in got] == [[n for n, _ in b] for b in buckets]
    for bucket, back in zip(buckets, got):
        for (_, want), (name, have) in zip(bucket, back):
            assert have.dtype == want.dtype and have.shape == want.shape, name
            assert torch.equal(have, want), name
