"""Build-once directories under the scaletrain cache (shared by the embedded default and prepared models).

A cached directory is complete when its stamp file (written last) holds the parameters it was built with. A build
goes into a temporary sibling directory that is renamed into place, so a crash leaves no half-built cache behind
that looks complete, and two processes building the same entry at once both end with the finished one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STAMP_FILE = "BUILD_COMPLETE.json"


def cache_root() -> Path:
    """``$SCALETRAIN_CACHE`` when that variable is set, else ``~/.cache/scaletrain``."""
    root = os.environ.get("SCALETRAIN_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "scaletrain"


def read_stamp(root: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(root) / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def build_once(root: str | os.PathLike, params: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """``root`` built by ``build(tmp_dir)`` unless it is already complete for ``params``; returns ``root``.

    ``params`` must be JSON-serialisable: a stamp with other parameters (an older build, other sizes) is rebuilt.
    """
    root = Path(root)
    if read_stamp(root) == params:
        logger.debug("cached: %s", root)
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        build(tmp)
        (tmp / STAMP_FILE).write_text(json.dumps(params))  # last: marks the build complete
        if root.exists():  # half-built or stale
            shutil.rmtree(root, ignore_errors=True)
        try:
            os.rename(tmp, root)
        except OSError:
            if read_stamp(root) != params:  # not a concurrent builder that finished first
                raise
            logger.debug("another process finished building %s first", root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root
