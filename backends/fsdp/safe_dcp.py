"""``dcp.load`` without running code from the checkpoint (layer 2, the FSDP engine's resume: checkpoint.py).

torch.distributed.checkpoint reads a checkpoint's ``.metadata`` with plain ``pickle.load`` and its byte items (the
optimizer's ``param_groups`` values, anything not a tensor) with ``torch.load(weights_only=False)``: a tampered file
of either kind would run its payload in every rank. ``safe_dcp_load`` reads the metadata with an unpickler that
resolves only DCP's own metadata classes, ``torch.Size``, dtypes, layouts and paths, and checks each byte item with
``weights_only=True`` before DCP decodes it; anything else fails with ``UnsafeCheckpointError`` naming the file and
the object (backends/checkpoint/safe_load.py), raised on every rank.
"""

from __future__ import annotations

import io
from typing import Any, BinaryIO, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from backends.checkpoint.safe_load import UnsafeCheckpointError, check_torch_bytes, load_pickle_allowing

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name: a lookup, nothing else
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
}


def _metadata_global(module: str, name: str) -> bool:
    if (module, name) in _METADATA_CLASSES:
        return True
    # a dtype pickles as the name of the torch attribute holding it (torch.float32, torch.bfloat16, ...)
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            # torch annotates the stream as an IOBase; opened "rb", it is a binary file
            metadata = load_pickle_allowing(cast(BinaryIO, stream), _metadata_global, str(path))
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # DCP decodes the item with weights_only=False: it gets only bytes that weights_only=True accepted
        check_torch_bytes(value, f"{self.where} (item {read_item.dest_index.fqn})")
        super().load_bytes(read_item, value)


def safe_dcp_metadata(checkpoint_dir: str) -> Metadata:
    """The checkpoint's DCP metadata (what tensors it holds, their global shapes), read with the allow-list."""
    return _SafeReader(checkpoint_dir).read_metadata()


def safe_dcp_load(state: dict, checkpoint_dir: str, no_dist: bool = False) -> None:
    """``dcp.load(state, checkpoint_id=checkpoint_dir)`` with the metadata and byte items checked (collective;
    ``no_dist``: this process alone, even in a process group)."""
    reader = _SafeReader(checkpoint_dir)
    reader.read_metadata()  # first on its own: inside dcp.load, a refusal reaches us as an AssertionError's text
    planner = _SafePlanner(checkpoint_dir)
    try:
        # torch re-exports load without listing it in __all__
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)  # pyright: ignore[reportPrivateImportUsage]
    except CheckpointException as e:  # DCP gathers every rank's failure: raise ours as such, on every rank
        for failure, _trace in e.failures.values():
            if isinstance(failure, UnsafeCheckpointError):
                raise UnsafeCheckpointError(str(failure)) from None
        raise
