"""The reward-model worker on megatron (real Ray, gloo, 2 ranks, TP=2): the sequence classifier runs as megatron's
value model read at each row's last valid token, and its scores must equal transformers'
AutoModelForSequenceClassification on each unpadded sequence. (fsdp: test_role_workers.py through the same worker;
deepspeed: the ``reward_scores`` check of tests/backends/test_deepspeed_engine.py's 2-rank launch.)"""

import pytest

from backends.config import EngineConfig, ModelConfig
from scaletrain.workers import EngineSetup, RewardModelConfig, RewardModelWorker
from tests.backends.tiny import make_batch, reference_rm_scores, save_tiny_reward_model
from tests.controller.workers import started_group

pytestmark = pytest.mark.slow


def test_reward_model_on_megatron_tp2_equals_transformers(ray_cluster, tmp_path):
    path = save_tiny_reward_model(str(tmp_path / "rm"))
    batch = make_batch(batch_size=6, prompt_len=8, response_len=6, seed=11)
    config = RewardModelConfig(micro_batch_size_per_gpu=2)  # 3 micro-batches: the rows' order must be kept
    setup = EngineSetup(
        model=ModelConfig(path=path, kind="reward"),
        backend="megatron",
        engine=EngineConfig(extra={"megatron": {"tensor_model_parallel_size": 2}}),
    )
    with started_group(
        ray_cluster, 2, RewardModelWorker, config, setup, use_gpu=False, name_prefix="rm_megatron"
    ) as wg:
        wg.init_model()
        scores = wg.compute_rm_score(batch).batch["rm_scores"]
    expected = reference_rm_scores(path, batch)
    last = batch.batch["response_mask"].sum(-1) - 1
    got = [scores[i, last[i]].item() for i in range(len(batch))]
    assert got == pytest.approx(expected.tolist(), abs=1e-4)
    assert (scores != 0).sum().item() == len(batch)  # one score per row, at its last response token only
    assert expected.max() - expected.min() > 0.1  # the rows' scores differ: the pooling position matters
