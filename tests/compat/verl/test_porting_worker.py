"""The porting guide's worker example (docs/porting.md): a worker written for verl, unedited but for its import
lines, driven by scaletrain's RayWorkerGroup on the suite's Ray cluster: a data-parallel method over padded shares,
a mesh method over the places it declared verl's way, and the metrics every rank reports reaching the driver."""

from __future__ import annotations

import pytest
import ray
import torch

# --- a verl user's worker, unedited but for these imports (verl's: from verl import DataProto;
# from verl.single_controller.base import Worker; from verl.single_controller.base.decorator import ...;
# from verl.single_controller.ray import ...) ---
from scaletrain.compat.verl import DataProto
from scaletrain.compat.verl.single_controller.base import Worker
from scaletrain.compat.verl.single_controller.base.decorator import (
    Dispatch,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from scaletrain.compat.verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup


@ray.remote
class LengthScorer(Worker):
    def __init__(self, bonus: float) -> None:
        super().__init__()
        self.bonus = bonus
        # one data-parallel rank per process, every output collected
        self._register_dispatch_collect_info(mesh_name="score", dp_rank=self.rank, is_collect=True)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def score(self, data: DataProto) -> DataProto:
        scores = data.batch["attention_mask"].sum(-1).float() + self.bonus + self.rank
        return DataProto.from_dict({"scores": scores}, meta_info={"metrics": {"worker/rows": len(data)}})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="score"))
    def double(self, data: DataProto) -> DataProto:
        data.batch["doubled"] = data.batch["attention_mask"] * 2
        return data


# --- end of the user's worker ---


@pytest.mark.slow
def test_a_verl_worker_runs_in_scaletrains_worker_group(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(LengthScorer, bonus=10.0), name_prefix="verl_port")
    try:
        mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0]])
        out = group.score(DataProto.from_dict({"attention_mask": mask}))  # 5 rows over 2 ranks: shares padded
        # rows 0-2 on rank 0, rows 3-4 (+1 padding row, trimmed) on rank 1
        assert out.batch["scores"].tolist() == [12.0, 11.0, 13.0, 13.0, 11.0]
        # each rank's metrics reach the driver (verl's concat): both shares held 3 rows, padding included
        assert out.meta_info["metrics"] == {"worker/rows": [3, 3]}
        doubled = group.double(DataProto.from_dict({"attention_mask": mask[:4]}))
        assert doubled.batch["doubled"].equal(mask[:4] * 2)
    finally:
        group.shutdown()
        pool.release()
