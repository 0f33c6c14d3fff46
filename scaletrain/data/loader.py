"""A deterministic, resumable batch loader over a map-style dataset (``len`` + ``__getitem__``).

Each ``iter(loader)`` runs (the rest of) one epoch and yields DataProto batches. With ``shuffle=True`` epoch ``e``
visits rows in ``numpy.random.default_rng(derive_seed(seed, e)).permutation(len(dataset))``; otherwise in order.
The loader counts the batches it has handed out, so ``state_dict()`` (``epoch``, ``batches_in_epoch``) taken
after consuming k batches and loaded into a fresh loader makes it yield exactly the batches the uninterrupted one
would have yielded next, across epoch boundaries. After the last batch of an epoch the state already reads
``(epoch + 1, 0)``: a checkpoint taken there resumes at the start of the next epoch.

No worker processes: rows are fetched and collated in the calling thread (tokenization happened when the
dataset was built, so this is cheap). Don't run two iterators of one loader at the same time: they share the
position.

Typical trainer use::

    loader = StatefulDataLoader(dataset, batch_size=32, seed=1)
    loader.load_state_dict(ckpt["dataloader"])          # when resuming
    while loader.epoch < total_epochs:
        for batch in loader:
            ...                                          # after the step: ckpt["dataloader"] = loader.state_dict()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from scaletrain.data.rl_dataset import collate_fn as default_collate
from scaletrain.protocol import DataProto
from scaletrain.utils.seeding import derive_seed

logger = logging.getLogger(__name__)

_CHECKED_KEYS = ("batch_size", "dataset_len", "shuffle", "seed", "drop_last")


class StatefulDataLoader:
    """Batches of ``dataset`` as DataProtos; ``state_dict`` / ``load_state_dict`` resume mid-epoch exactly.

    Args:
        dataset: anything with ``__len__`` and ``__getitem__(int)`` returning what ``collate_fn`` accepts.
        batch_size: rows per batch.
        shuffle: a fresh permutation each epoch, from ``derive_seed(seed, epoch)``.
        seed: the shuffle seed.
        drop_last: drop the last, smaller batch of each epoch.
        collate_fn: list of rows -> DataProto (default: ``rl_dataset.collate_fn``).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        collate_fn: Callable[[Sequence[Any]], DataProto] = default_collate,
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.collate_fn = collate_fn
        self._epoch = 0
        self._position = 0  # batches already handed out in the current epoch
        if len(self) == 0:
            raise ValueError(f"dataset of {len(dataset)} rows gives no batch of {batch_size} (drop_last={drop_last})")

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        self._normalize()
        return self._epoch

    @property
    def batches_in_epoch(self) -> int:
        """Batches of the current epoch already handed out."""
        self._normalize()
        return self._position

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The row order of ``epoch`` (a permutation when shuffling, else ``arange``)."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng(derive_seed(self.seed, epoch)).permutation(n)

    def _normalize(self) -> None:
        if self._position >= len(self):
            self._epoch += 1
            self._position = 0

    def __iter__(self) -> Iterator[DataProto]:
        self._normalize()
        epoch = self._epoch
        order = self.epoch_order(epoch)
        while self._epoch == epoch and self._position < len(self):
            start = self._position * self.batch_size
            indices = order[start : start + self.batch_size]
            batch = self.collate_fn([self.dataset[int(i)] for i in indices])
            self._position += 1
            yield batch
        self._normalize()

    # ----------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        self._normalize()
        return {
            "epoch": self._epoch,
            "batches_in_epoch": self._position,
            "batch_size": self.batch_size,
            "dataset_len": len(self.dataset),
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``; the dataset and batching settings must match the saved ones."""
        mine = self.state_dict()
        for key in _CHECKED_KEYS:
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"cannot resume the data loader exactly: saved {key}={state[key]!r}, this loader has "
                    f"{key}={mine[key]!r}"
                )
        epoch, position = int(state["epoch"]), int(state["batches_in_epoch"])
        if epoch < 0 or not 0 <= position <= len(self):
            raise ValueError(f"invalid data loader state: epoch={epoch}, batches_in_epoch={position}")
        self._epoch, self._position = epoch, position
        self._normalize()
        logger.info("data loader resumed at epoch %d, batch %d of %d", self._epoch, self._position, len(self))
