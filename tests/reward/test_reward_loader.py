"""Loading a user's reward function from a file: errors name the path/name; pickling reloads by path."""

import pickle

import pytest

from scaletrain.reward import build_reward_manager, load_custom_reward_fn
from scaletrain.reward.loader import CustomRewardFn


def _write(path, body):
    path.write_text(body)
    return path


def test_load_and_call(tmp_path):
    f = _write(
        tmp_path / "my_reward.py",
        "def compute_score(ds, s, gt, extra_info=None):\n    return 0.25\n"
        "def other(ds, s, gt, extra_info=None):\n    return 0.75\n",
    )
    assert load_custom_reward_fn(f)("d", "s", "g") == 0.25
    fn = load_custom_reward_fn(str(f), "other")
    assert isinstance(fn, CustomRewardFn) and fn.name == "other" and fn("d", "s", "g") == 0.75


def test_pickle_reloads_by_path(tmp_path):
    f = _write(tmp_path / "r.py", "def compute_score(*a, **k):\n    return 1.0\n")
    data = pickle.dumps(load_custom_reward_fn(f))
    assert str(f).encode() in data and b"compute_score" in data
    f.write_text("def compute_score(*a, **k):\n    return 2.0\n")  # the unpickled copy loads the file anew
    assert pickle.loads(data)("d", "s", "g") == 2.0


def test_bad_path(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_custom_reward_fn(missing, "my_fn")
    with pytest.raises(ValueError, match="empty"):
        load_custom_reward_fn("")


def test_missing_name(tmp_path):
    f = _write(tmp_path / "r.py", "def helper(*a):\n    return 1\nVALUE = 3\n")
    with pytest.raises(AttributeError) as info:
        load_custom_reward_fn(f, "compute_score")
    assert "'compute_score'" in str(info.value) and str(f) in str(info.value) and "helper" in str(info.value)
    with pytest.raises(TypeError, match="VALUE"):
        load_custom_reward_fn(f, "VALUE")


def test_import_error_names_path(tmp_path):
    f = _write(tmp_path / "broken.py", "import not_a_module_xyz\n")
    with pytest.raises(ImportError, match="broken.py"):
        load_custom_reward_fn(f)


def test_build_reward_manager(tokenizer, test_scorers_path):
    with pytest.raises(ValueError, match="naive"):  # lists the registered names
        build_reward_manager(tokenizer, "no_such_manager")
    manager = build_reward_manager(
        tokenizer, "naive", {"path": str(test_scorers_path), "name": "scaled", "reward_kwargs": {"scale": 3.0}}
    )
    with manager:
        assert manager.compute_score("d", "7", "7") == 3.0
    with build_reward_manager(tokenizer, "naive", {"path": None, "name": "compute_score"}) as manager:
        assert manager.compute_score.__name__ == "default_compute_score"


def test_a_file_whose_top_level_never_finishes_fails_naming_it(tmp_path):
    """A careless reward file (a loop at import, a download that hangs) fails within the limit, naming the file;
    the caller's thread goes on, and the stuck import is a daemon thread (it cannot hold the process open)."""
    import threading
    import time

    f = _write(tmp_path / "stuck.py", "import time\nwhile True:\n    time.sleep(0.05)\n")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"stuck\.py took more than 1 s.*reward_model\.load_timeout_s"):
        load_custom_reward_fn(f, load_timeout_s=1.0)
    assert time.monotonic() - start < 10
    stuck = [t for t in threading.enumerate() if t.name == "import stuck.py"]
    assert stuck and all(t.daemon for t in stuck)


def test_sys_exit_at_import_is_an_import_error(tmp_path):
    f = _write(tmp_path / "quits.py", "import sys\nsys.exit(3)\n")
    with pytest.raises(ImportError, match=r"quits\.py failed: SystemExit: 3"):
        load_custom_reward_fn(f)


def test_the_limit_travels_with_the_pickled_function(tmp_path):
    f = _write(tmp_path / "r.py", "def compute_score(*a, **k):\n    return 1.0\n")
    assert pickle.loads(pickle.dumps(load_custom_reward_fn(f, load_timeout_s=7.0))).load_timeout_s == 7.0
