"""``verl.utils.dataset``: the RL prompt dataset and its collate function."""

from scaletrain.compat.verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

__all__ = ["RLHFDataset", "collate_fn"]
