"""Checkpoints tampered with as an attacker who can write a run's checkpoint directory would (shared by the engine
tests' ``tampered_checkpoint_refused`` checks): a file of the engine's real checkpoint, written by its own writer,
gets a pickled call to ``os.makedirs(<canary>)``; loading must fail naming the file, and the canary must not exist.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil

import torch
import torch.distributed as dist


class Payload:
    """Unpickled in full, this runs ``os.makedirs(marker)``: what a malicious checkpoint would run instead."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def copy_checkpoint(engine, work: str, name: str) -> tuple[str, str]:
    """The engine's checkpoint saved to ``work/name`` (collective); returns it and a canary path (absent)."""
    path = os.path.join(work, name)
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    engine.save(path)
    return path, os.path.join(work, f"{name}.canary")


def inject_into_torch_file(path: str, marker: str) -> None:
    """One more entry in a ``torch.save``'d dict (the writer's own file, loaded trusting it): the payload."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    state["note"] = Payload(marker)
    torch.save(state, path)


def replace_dcp_metadata(dcp_dir: str, marker: str) -> str:
    """DCP's ``.metadata`` replaced by a pickle of the payload; returns the file's path."""
    path = os.path.join(dcp_dir, ".metadata")
    with open(path, "wb") as f:
        pickle.dump(Payload(marker), f)
    return path


def redirect_dcp_bytes_item(dcp_dir: str, marker: str) -> str:
    """A byte item of the checkpoint (an optimizer ``param_groups`` value) pointed at a ``torch.save`` of the
    payload appended to its data file, the metadata rewritten to match; returns the item's name."""
    meta_path = os.path.join(dcp_dir, ".metadata")
    with open(meta_path, "rb") as f:
        metadata = pickle.load(f)  # our own writer's file, before the tampering
    index = next(i for i, info in metadata.storage_data.items() if "param_groups" in i.fqn)
    info = metadata.storage_data[index]
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    data_file = os.path.join(dcp_dir, info.relative_path)
    offset = os.path.getsize(data_file)
    with open(data_file, "ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buffer.getvalue()))
    with open(meta_path, "wb") as f:
        pickle.dump(metadata, f)
    return index.fqn


def assert_refused(load, names: list[str], marker: str) -> None:
    """``load()`` fails with UnsafeCheckpointError naming each of ``names`` and the payload's function, and
    the payload did not run."""
    from backends.checkpoint.safe_load import UnsafeCheckpointError

    try:
        load()
    except UnsafeCheckpointError as e:
        for name in [*names, "makedirs"]:
            assert name in str(e), (name, str(e))
    else:
        raise AssertionError("a tampered checkpoint loaded")
    assert not os.path.exists(marker), "the checkpoint's payload ran"
