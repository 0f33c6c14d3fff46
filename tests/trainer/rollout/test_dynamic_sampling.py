"""DAPO dynamic sampling (group filtering + refill from the loader), overlong filtering and ReMax's greedy baseline:
the driver-side logic, without Ray (the CLI runs are in test_dapo_remax_run.py)."""

import numpy as np
import pytest
import torch

from backends.rollout.base import SamplingConfig
from scaletrain.data import StatefulDataLoader
from scaletrain.protocol import DataProto
from scaletrain.trainer.config.ppo_config import FilterGroupsConfig, load_ppo_config
from scaletrain.trainer.rollout.dynamic_sampling import Scored, collect_groups, kept_rows, metric_values
from scaletrain.trainer.rollout.producer import RolloutProducer
from scaletrain.trainer.rollout.remax import greedy_baseline
from scaletrain.trainer.step.overlong import mask_overlong_responses, truncated_rows
from scaletrain.workers import RolloutWorkerConfig
from tests.trainer.config.test_ppo_config import checked, composed

N = 2  # samples per prompt


def scored_batch(prompts: list[int], gen_index: int, acc_of) -> Scored:
    """N rows per prompt id; ``acc_of(prompt, sample)`` is each row's extra-info ``acc`` and its score."""
    uids = [f"g{gen_index}-{p}" for p in prompts for _ in range(N)]
    acc = [float(acc_of(p, s)) for p in prompts for s in range(N)]
    scores = torch.zeros(len(uids), 3)
    scores[:, -1] = torch.tensor(acc)
    batch = DataProto.from_dict(
        {"token_level_scores": scores, "prompt_id": torch.tensor(np.repeat(prompts, N))}, {"uid": uids}
    )
    reward = {
        "reward_tensor": scores.clone(),
        "reward_extra_info": {"acc": acc, "pred": [str(a) for a in acc]},
        "metrics": {},
    }
    return Scored(batch, reward, {"reward/score_mean": float(np.mean(acc))})


class Prompts:
    """A dataset of prompt ids 0..size-1 for the real StatefulDataLoader."""

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return i


def loader(size=40, batch=4):
    return StatefulDataLoader(
        Prompts(size),
        batch,
        shuffle=True,
        seed=3,
        collate_fn=lambda rows: DataProto.from_dict(non_tensors={"pid": list(rows)}),
    )


def rollout_for(acc_of, calls):
    def rollout(prompts: DataProto, gen_index: int) -> Scored:
        calls.append(list(prompts.non_tensor_batch["pid"]))
        return scored_batch(list(prompts.non_tensor_batch["pid"]), gen_index, acc_of)

    return rollout


def test_kept_rows_drops_groups_whose_metric_is_equal():
    uids = np.array(["a", "a", "b", "b", "c", "c", "d"], dtype=object)
    values = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    keep, kept, groups = kept_rows(uids, values)
    assert keep.tolist() == [True, True, False, False, False, False, True]  # a singleton group is kept (verl)
    assert (kept, groups) == (2, 4)


def test_metric_values_reads_extra_info_and_sequence_sums():
    scored = scored_batch([0, 1], 0, lambda p, s: p == 1 and s == 0)
    assert metric_values(scored, "acc").tolist() == [0, 0, 1, 0]
    assert metric_values(scored, "seq_reward").tolist() == [0, 0, 1, 0]
    assert metric_values(scored, "seq_final_reward").tolist() == [0, 0, 1, 0]
    with pytest.raises(ValueError, match="metric='nope'.*available: acc, pred, seq_final_reward, seq_reward"):
        metric_values(scored, "nope")
    scored.reward["reward_extra_info"]["acc"][1] = None
    with pytest.raises(ValueError, match="some samples lack it"):
        metric_values(scored, "acc")


def test_collect_groups_refills_from_the_loader_and_trims_to_the_batch_size():
    # odd prompt ids have one right and one wrong sample (kept), even ones agree (dropped): ~half kept per batch
    data, calls = loader(), []
    first = next(iter(data))
    scored, metrics = collect_groups(
        first,
        rollout_for(lambda p, s: p % 2 and s == 0, calls),
        lambda: next(iter(data)),
        FilterGroupsConfig(enable=True),
        train_batch_size=4,
    )
    pids = [p for batch in calls for p in batch]
    odd = [p for p in pids if p % 2]
    assert len(calls) == metrics["train/num_gen_batches"] > 1
    assert metrics["train/kept_group_ratio"] == len(odd) / len(pids)
    # exactly 4 groups of N rows, the first odd prompts in generation order, each group whole and in order
    assert scored.batch.batch["prompt_id"].tolist() == [p for p in odd[:4] for _ in range(N)]
    assert len(scored.batch) == 4 * N and scored.reward["reward_tensor"].shape == (4 * N, 3)
    assert scored.reward["reward_extra_info"]["acc"] == [1.0, 0.0] * 4
    # the loader handed out exactly the batches generated, so a checkpoint taken now resumes after them
    assert data.state_dict()["batches_in_epoch"] == len(calls)
    resumed = loader()
    resumed.load_state_dict(data.state_dict())
    following = next(iter(resumed)).non_tensor_batch["pid"].tolist()
    assert following == next(iter(data)).non_tensor_batch["pid"].tolist() and not set(following) & set(pids)


def test_collect_groups_crosses_epochs_and_ends_the_outer_epoch_loop():
    # 2 batches per epoch and only prompt 0's group varies: the second kept group needs epoch 1's copy of prompt 0
    data, calls = loader(size=8, batch=4), []
    outer = iter(data)  # fit()'s epoch loop
    scored, metrics = collect_groups(
        next(outer),
        rollout_for(lambda p, s: p == 0 and s == 0, calls),
        lambda: next(iter(data)),
        FilterGroupsConfig(enable=True),
        train_batch_size=2,
    )
    assert scored.batch.batch["prompt_id"].tolist() == [0, 0, 0, 0]
    assert len(set(scored.batch.non_tensor_batch["uid"])) == 2  # one group from each epoch
    state = data.state_dict()  # the loader handed out exactly the batches generated (2 an epoch), past epoch 0
    assert len(calls) == 2 * state["epoch"] + state["batches_in_epoch"] == metrics["train/num_gen_batches"] > 2
    assert 0 in calls[-1] and list(outer) == []  # epoch 0's loop sees its batches used up and ends


def test_collect_groups_fails_after_max_num_gen_batches():
    data, calls = loader(), []
    config = FilterGroupsConfig(enable=True, metric="acc", max_num_gen_batches=3)
    with pytest.raises(
        RuntimeError,
        match=r"3 generation batches \(algorithm.filter_groups.max_num_gen_batches=3\) "
        r"kept only 0 of data.train_batch_size=4",
    ):
        collect_groups(next(iter(data)), rollout_for(lambda p, s: 1, calls), lambda: next(iter(data)), config, 4)
    assert len(calls) == 3


def test_collect_groups_averages_metrics_and_stops_at_once_when_the_first_batch_suffices():
    data, calls = loader(), []
    scored, metrics = collect_groups(
        next(iter(data)),
        rollout_for(lambda p, s: s, calls),
        lambda: next(iter(data)),
        FilterGroupsConfig(enable=True, metric="seq_reward"),
        4,
    )
    assert metrics == {"train/num_gen_batches": 1.0, "train/kept_group_ratio": 1.0}
    assert scored.metrics == {"reward/score_mean": 0.5} and len(calls) == 1


def test_filter_defaults_match_verl_and_validate():
    cfg = checked("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=-1")
    assert cfg.algorithm.filter_groups.metric == "acc" and not cfg.algorithm.filter_overlong_responses
    assert FilterGroupsConfig() == FilterGroupsConfig(enable=False, metric="acc", max_num_gen_batches=0)


def rollout_rows(responses, prompt_len=2, eos=7, pad=0):
    """Rollout-layout rows: responses right-padded, attention 1 up to and including the first EOS."""
    resp = torch.tensor(responses)
    is_eos = (resp == eos).long()
    resp_mask = ((is_eos.cumsum(-1) - is_eos) == 0).long() & (resp != pad).long()
    attn = torch.cat([torch.ones(len(responses), prompt_len, dtype=torch.long), resp_mask], -1)
    return DataProto.from_dict({"responses": resp, "attention_mask": attn, "response_mask": resp_mask.clone()})


def test_overlong_rows_are_those_that_fill_the_length_without_eos():
    # ended early | ended with EOS at the last position | cut off | cut off (an EOS id elsewhere does not count)
    batch = rollout_rows([[5, 7, 0, 0], [5, 5, 5, 7], [5, 5, 5, 5], [5, 5, 5, 6]])
    assert truncated_rows(batch, [7, 6]).tolist() == [False, False, True, False]
    before = batch.batch["response_mask"].clone()
    metrics = mask_overlong_responses(batch, [7])
    assert metrics == {"train/overlong_masked": 2.0, "train/overlong_masked_ratio": 0.5}
    assert batch.batch["response_mask"][2:].sum() == 0
    assert torch.equal(batch.batch["response_mask"][:2], before[:2])


def test_greedy_baseline_generates_greedily_one_per_prompt_and_scores_it():
    prompts = DataProto.from_dict(non_tensors={"data_source": ["a", "b"], "uid": ["u0", "u1"]})
    gen_batch = DataProto.from_dict({"input_ids": torch.tensor([[1, 2], [3, 4]])})
    sampling = SamplingConfig(n=4, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=8, seed=9)
    seen = {}

    def generate(batch, gen, call_sampling, tag):
        seen.update(sampling=call_sampling, tag=tag)
        return DataProto.from_dict({"responses": gen.batch["input_ids"] * 10}), {}

    def reward_fn(rows, return_dict):
        seen["sources"] = list(rows.non_tensor_batch["data_source"])
        return {"reward_tensor": rows.batch["responses"].float()}

    scores, metrics = greedy_baseline(generate, reward_fn, prompts, gen_batch, sampling, "step3")
    # the samples' sampling (its seed, top-p, length) made greedy: one response per prompt at temperature 0
    assert seen["sampling"] == SamplingConfig(n=1, temperature=0.0, top_p=0.9, top_k=5, max_new_tokens=8, seed=9)
    assert seen["tag"] == "step3-greedy" and seen["sources"] == ["a", "b"]
    assert scores.tolist() == [30.0, 70.0] and metrics == {"critic/remax_baseline/mean": 50.0}


class RecordingManager:
    """The agent loops as the producer calls them: records each call's sampling and n."""

    def generate_sequences(self, rows, sampling, n, tag, on_trajectory=None):
        self.call = (sampling, n)
        return DataProto.from_dict({"x": torch.zeros(len(rows) * n, 1)})


class RecordingRollout:
    """The rollout role as the producer calls it (the worker group's batched generate)."""

    def generate(self, gen_batch, sampling):
        self.call = sampling
        return DataProto.from_dict({"x": torch.zeros(len(gen_batch) * sampling.n, 1)})


def producer_for(*overrides: str, agent_loops: bool) -> RolloutProducer:
    cfg = load_ppo_config(composed(*overrides))
    manager = RecordingManager() if agent_loops else None
    return RolloutProducer(cfg, RecordingRollout(), None, None, None, None, agent_manager=manager)


def test_both_rollout_paths_take_the_sampling_chosen_for_the_call():
    """One typed sampling per generate call (training, validation, greedy), chosen by the producer and taken as it
    is by the batched path (the worker's generate) and by the agent loops."""
    overrides = ("actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.top_p=0.9")
    prompts = DataProto.from_dict(non_tensors={"uid": ["u0", "u1"]})
    gen_batch = DataProto.from_dict({"input_ids": torch.tensor([[1, 2], [3, 4]])})
    batched, agents = producer_for(*overrides, agent_loops=False), producer_for(*overrides, agent_loops=True)
    rc = batched.sampling_cfg
    train = rc.train_sampling(seed=5)
    assert (train.n, train.temperature, train.top_p, train.seed) == (4, 1.0, 0.9, 5)
    for sampling in (train, rc.validation_sampling(), SamplingConfig(n=1, temperature=0.0, seed=5)):
        out, _ = batched.generate(prompts, gen_batch, sampling, "t")
        assert batched.rollout.call == sampling and len(out) == 2 * sampling.n
        out, _ = agents.generate(prompts, gen_batch, sampling, "t")
        want = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}
        assert agents.agent_manager.call == ({**want, "seed": sampling.seed}, sampling.n) and len(out) == 2 * sampling.n


def test_validation_sampling_is_val_kwargs_over_the_training_sampling():
    def validation(**val_kwargs):
        return RolloutWorkerConfig(n=4, top_p=0.9, response_length=8, val_kwargs=val_kwargs).validation_sampling()

    default = RolloutWorkerConfig(n=4).validation_sampling()
    assert (default.n, default.temperature, default.seed) == (1, 0.0, 0)  # greedy, one per prompt
    # no n given: one sample per prompt (verl's default), not the training n; the rest of training's sampling kept
    assert validation(temperature=0.6) == SamplingConfig(n=1, temperature=0.6, top_p=0.9, max_new_tokens=8, seed=0)
    assert validation(n=3, temperature=0.6, do_sample=False).n == 3
    assert validation(n=3, temperature=0.6, do_sample=False).temperature == 0.0
