"""Durable, atomic directory writes, shared by the run checkpoints (scaletrain/trainer/run/checkpoint.py) and the HF
export (backends/checkpoint/hf_export.py).

- ``fsync_tree(path)`` fsyncs every file and directory under ``path``, so a rename that publishes ``path``
  publishes data that is on disk, not only in the page cache (a power loss after the rename cannot leave empty or
  truncated files under the final name).
- ``replace_dir(src, dst, aside)`` publishes the finished directory ``src`` as ``dst``: an existing ``dst`` is
  renamed to ``aside`` first, ``src`` renamed to ``dst``, the parent directory fsync'd, and only then the old copy
  deleted. At every moment one complete copy exists under ``dst`` or ``aside``; ``restore_aside`` puts the old copy
  back after a crash between the two renames.
"""

from __future__ import annotations

import logging
import os
import shutil

logger = logging.getLogger(__name__)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)  # fsync needs a descriptor, not write access; works for directories too
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (creations, renames, deletions) durable."""
    _fsync_path(path)


def fsync_tree(path: str) -> None:
    """fsync every regular file and directory under ``path`` (``path`` included), deepest first. Symbolic links are
    neither followed nor fsync'd."""
    for dirpath, _dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            file = os.path.join(dirpath, name)
            if not os.path.islink(file):
                _fsync_path(file)
        _fsync_path(dirpath)


def replace_dir(src: str, dst: str, aside: str) -> None:
    """Rename the finished directory ``src`` to ``dst``, replacing an existing ``dst`` without a moment where no
    complete copy exists: the old one waits under ``aside`` until the new one is in place, then is deleted."""
    parent = os.path.dirname(os.path.abspath(dst))
    had_old = os.path.lexists(dst)
    if had_old:
        shutil.rmtree(aside, ignore_errors=True)  # a stale copy from an earlier replace: dst is newer
        os.rename(dst, aside)
    try:
        os.rename(src, dst)
    except OSError:
        if had_old:
            os.rename(aside, dst)
        raise
    fsync_dir(parent)
    if had_old:
        shutil.rmtree(aside, ignore_errors=True)


def restore_aside(dst: str, aside: str) -> None:
    """Finish a ``replace_dir`` that a crash interrupted: bring ``aside`` back when ``dst`` is missing, else drop it."""
    if not os.path.isdir(aside):
        return
    if os.path.lexists(dst):
        shutil.rmtree(aside, ignore_errors=True)
        return
    logger.warning("restoring %s from %s (a replace of it was interrupted)", dst, aside)
    os.rename(aside, dst)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))
