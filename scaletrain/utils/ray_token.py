"""A fresh Ray auth token for a private Ray cluster (shared utility, used by the trainer's ``ray_cluster``).

Left to itself, Ray 2.60 secures a local cluster with one token per user, ``~/.ray/auth_token``, created with the
default umask (mode 0644 here: readable by every local user) and reused by every cluster that user starts. A
private cluster of a run gets its own instead: a random token in a 0600 file inside a 0700 directory, named to Ray
by ``RAY_AUTH_TOKEN_PATH`` for the driver and every process the cluster starts (they inherit the environment), and
removed when the run ends. A token the user gave (``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``, as launch/run.sh
exports) is used as given, and ``RAY_AUTH_MODE=disabled`` is the user's explicit opt-out (Ray warns).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

TOKEN_VARIABLES = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def user_chose_auth() -> bool:
    """The environment already says how the cluster authenticates: a token of the user's, or auth turned off."""
    disabled = os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled"
    return disabled or any(os.environ.get(name) for name in TOKEN_VARIABLES)


def write_private_token(folder: Path) -> Path:
    """A new random token in ``folder/auth_token``, created with mode 0600 (never readable by another user)."""
    path = folder / "auth_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def _reset_ray_token_cache() -> None:
    # the driver's token loader caches the first token it read: a second private run of this process needs its own
    # compiled into Ray's _raylet extension, which Ray's stubs leave out
    from ray._raylet import AuthenticationTokenLoader  # pyright: ignore[reportAttributeAccessIssue]

    AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def private_cluster_token() -> Iterator[Path | None]:
    """For the ``with`` block, ``RAY_AUTH_TOKEN_PATH`` names a fresh 0600 token file (yielded); ``None`` and nothing
    changed where the user already chose (``user_chose_auth``). Start the cluster inside the block, stop it before
    the block ends: the file goes with it."""
    if user_chose_auth():
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="scaletrain-ray-auth-"))  # mkdtemp: mode 0700
    path = write_private_token(folder)
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    _reset_ray_token_cache()
    try:
        yield path
    finally:
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        _reset_ray_token_cache()
        shutil.rmtree(folder, ignore_errors=True)
