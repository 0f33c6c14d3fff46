"""verl's ways of handing a reward manager its scorer and batch, on scaletrain's managers: a scorer that cannot be
pickled (scored in this process, still bounded by its timeout, on the main thread and off it), scorers called by
keyword, the ``reward_fn_key`` column, a tokenizer with ``decode`` only; and a manager that implements only verl's
interface, run as the trainer runs it (ExternalRewardManager), refused with its name when what it returns is
malformed."""

from __future__ import annotations

import logging
import signal
import threading
import time

import numpy as np
import pytest
import torch

from scaletrain.reward import NaiveRewardManager, build_reward_manager
from scaletrain.reward.in_process import InProcessScorer, score_timeout
from scaletrain.reward.managers import REWARD_MANAGERS, AbstractRewardManager, register_reward_manager
from scaletrain.reward.managers.external import ExternalRewardManager
from scaletrain.utils.errors import InvalidInput

ROWS = [
    {"prompt": "1+1=", "response": "2", "ground_truth": "2"},
    {"prompt": "2+2=", "response": "5", "ground_truth": "4"},
]


def test_a_closure_scorer_runs_in_process_and_its_timeout_still_holds(tokenizer, make_batch, caplog):
    def slow_on_wrong(data_source, solution_str, ground_truth, extra_info=None):  # a closure: not picklable
        if solution_str != ground_truth:
            time.sleep(30)
        return 1.0

    with caplog.at_level(logging.WARNING, logger="scaletrain.reward.in_process"):
        manager = NaiveRewardManager(tokenizer, compute_score=slow_on_wrong, compute_score_timeout=0.5)
    assert isinstance(manager.pool, InProcessScorer)
    assert any("cannot be sent to reward worker processes" in r.getMessage() for r in caplog.records)

    start = time.monotonic()
    out = manager(make_batch(ROWS), return_dict=True)  # on the main thread: SIGALRM interrupts the sleep
    assert time.monotonic() - start < 5
    assert out["reward_extra_info"]["score"] == [1.0, 0.0] and out["metrics"]["reward/timeouts"] == 1
    assert "timed out after 0.5s" in manager.last_error

    box = []  # off the main thread (the trainer's rollout thread): the caller stops waiting at the deadline
    thread = threading.Thread(target=lambda: box.append(manager(make_batch(ROWS), return_dict=True)))
    start = time.monotonic()
    thread.start()
    thread.join(10)
    assert box and time.monotonic() - start < 5
    assert box[0]["metrics"]["reward/timeouts"] == 1 and manager.pool.abandoned == 1


def test_the_in_process_timeout_hands_back_an_alarm_set_before_it():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)  # pytest-timeout's, or a caller's
        with score_timeout(5.0):
            pass
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < left <= 1.0, "the outer alarm was cancelled"
        time.sleep(1.2)
        assert fired == [True], "the outer handler was not put back"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_scorers_are_called_by_keyword_with_verls_extra_info(tokenizer, make_batch):
    seen = []

    def keyword_order(solution_str, ground_truth, data_source=None, extra_info=None):  # not verl's positional order
        seen.append((data_source, extra_info["num_turns"], extra_info["rollout_reward_scores"]))
        return float(solution_str == ground_truth)

    batch = make_batch(ROWS, data_source="unused")
    batch.non_tensor_batch["source"] = np.array(["a", "b"], dtype=object)  # verl's data.reward_fn_key
    batch.non_tensor_batch["__num_turns__"] = np.array([3, 1], dtype=object)
    with NaiveRewardManager(tokenizer, compute_score=keyword_order, reward_fn_key="source") as manager:
        assert manager(batch, return_dict=True)["reward_extra_info"]["score"] == [1.0, 0.0]
    assert seen == [("a", 3, {}), ("b", 1, {})]


class DecodeOnly:
    """A tokenizer stand-in as verl's tests write one: ``decode`` and nothing else."""

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def decode(self, ids, skip_special_tokens=True):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_tokenizer_with_decode_only(tokenizer, make_batch, caplog):
    with caplog.at_level(logging.WARNING), NaiveRewardManager(DecodeOnly(tokenizer)) as manager:
        out = manager(make_batch(ROWS), return_dict=True)
    assert out["reward_extra_info"]["score"] == [0.0, 0.0]  # arithmetic gives credit only to answers with EOS
    assert any("no EOS token id known" in r.getMessage() for r in caplog.records)


# --- a manager written against verl's interface alone ---
class TensorOnly(AbstractRewardManager):
    def __init__(self, tokenizer, num_examine, compute_score=None, reward_fn_key="data_source", shape=None):
        self.shape = shape

    def __call__(self, data, return_dict=False):
        if self.shape == "extra":
            return {
                "reward_tensor": torch.zeros_like(data.batch["responses"], dtype=torch.float32),
                "reward_extra_info": {"acc": [1.0]},
            }
        reward = torch.zeros(self.shape or data.batch["responses"].shape)
        reward[:, -1] = 1.0
        return reward


@pytest.fixture
def tensor_only():
    register_reward_manager("test_tensor_only")(TensorOnly)
    yield "test_tensor_only"
    del REWARD_MANAGERS["test_tensor_only"]


def test_a_verl_interface_manager_runs_as_the_trainer_runs_it(tokenizer, make_batch, tensor_only, caplog):
    offered = {"compute_score_timeout": 30.0, "num_processes": 2, "max_resp_len": 4}  # the trainer's
    with caplog.at_level(logging.INFO, logger="scaletrain.reward.build"):
        manager = build_reward_manager(tokenizer, tensor_only, offered=offered)
    assert isinstance(manager, ExternalRewardManager) and isinstance(manager.manager, TensorOnly)
    assert any(
        "does not take ['compute_score_timeout', 'max_resp_len', 'num_processes']" in r.getMessage()
        for r in caplog.records
    )
    batch = make_batch(ROWS)
    out = manager(batch, return_dict=True)
    assert out["reward_tensor"][:, -1].tolist() == [1.0, 1.0] and out["reward_extra_info"] == {}
    assert out["metrics"]["reward/score_mean"] == 1.0 and "reward/seconds" in out["metrics"]
    assert torch.equal(manager(batch), out["reward_tensor"])

    with pytest.raises(InvalidInput, match=r"TensorOnly returned a reward_tensor of shape \(2, 3\)"):
        build_reward_manager(tokenizer, tensor_only, shape=(2, 3))(batch)
    with pytest.raises(InvalidInput, match=r"reward_extra_info\['acc'\] with 1 values for 2 rows"):
        build_reward_manager(tokenizer, tensor_only, shape="extra")(batch)


def test_the_trainers_response_length_reaches_dapo_unless_its_kwargs_set_one(tokenizer):
    offered = {"compute_score_timeout": 5.0, "max_resp_len": 64}  # ppo_trainer.py offers data.max_response_length
    overlong = {"enable": True, "len": 16, "penalty_factor": 1.0}
    with build_reward_manager(tokenizer, "dapo", offered=offered, overlong_buffer_cfg=overlong) as manager:
        assert manager.max_resp_len == 64 and manager.pool.timeout_s == 5.0
    with build_reward_manager(tokenizer, "dapo", offered=offered, overlong_buffer_cfg=overlong, max_resp_len=32) as m:
        assert m.max_resp_len == 32
    with build_reward_manager(tokenizer, "naive", offered=offered) as manager:  # takes the timeout, not the length
        assert manager.pool.timeout_s == 5.0
