"""scaletrain/utils/ray_token.py: a private cluster's fresh token file (0600 in a 0700 directory, gone at the end),
and the user's own choice (a token, a token file, auth turned off) left as given."""

import os
import stat
from pathlib import Path

import pytest

from scaletrain.utils import ray_token
from scaletrain.utils.ray_token import private_cluster_token


@pytest.fixture
def bare_env(monkeypatch):
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    # this process may hold the session's Ray connection: its token cache stays as it is (two private clusters in
    # one process, which need the reset, run in tests/faults/test_ray_auth_faults.py)
    monkeypatch.setattr(ray_token, "_reset_ray_token_cache", lambda: None)


def test_a_fresh_private_token_per_block(bare_env):
    seen = []
    for _ in range(2):
        with private_cluster_token() as path:
            assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(path)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
            token = path.read_text()
            assert len(token) == 64 and int(token, 16) >= 0
            seen.append(token)
        assert not path.exists() and not path.parent.exists() and "RAY_AUTH_TOKEN_PATH" not in os.environ
    assert seen[0] != seen[1]


@pytest.mark.parametrize(
    "name,value",
    [("RAY_AUTH_TOKEN", "a" * 64), ("RAY_AUTH_TOKEN_PATH", "/run/secrets/ray"), ("RAY_AUTH_MODE", "disabled")],
)
def test_the_users_choice_is_kept(bare_env, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with private_cluster_token() as path:
        assert path is None and os.environ[name] == value
        assert os.environ.get("RAY_AUTH_TOKEN_PATH") in (None, value)
    assert os.environ[name] == value


def test_the_token_file_goes_when_the_run_fails(bare_env):
    with pytest.raises(RuntimeError), private_cluster_token() as path:
        raise RuntimeError("the run failed")
    assert not Path(path).exists() and "RAY_AUTH_TOKEN_PATH" not in os.environ
