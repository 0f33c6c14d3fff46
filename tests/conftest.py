"""Shared test fixtures: one real local Ray cluster per pytest session (fake GPUs declared), small thread counts."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from scaletrain.utils.gc_tuning import start_process  # noqa: E402

start_process()  # this process drives in-process runs: the collector set as in a run's driver (main_ppo.py)


@pytest.fixture(scope="session", autouse=True)
def ray_auth_token():
    """Ray's token authentication on for the whole session, as in a user's run: a fresh token of this pytest process
    (each xdist worker its own) in a 0600 file, named by RAY_AUTH_TOKEN_PATH for its Ray cluster and every process
    it starts (scaletrain/utils/ray_token.py). A developer's RAY_AUTH_MODE=disabled or own token is kept."""
    from scaletrain.utils.ray_token import private_cluster_token

    with private_cluster_token() as path:
        yield path


@pytest.fixture(scope="session")
def ray_cluster(ray_auth_token):
    """A local Ray cluster with 16 CPUs and 8 fake GPUs declared (CPU torch ignores CUDA_VISIBLE_DEVICES)."""
    import ray

    from scaletrain.utils.gc_tuning import SETUP_HOOK

    if not ray.is_initialized():
        ray.init(
            address="local",  # a private cluster, never a stale or foreign one
            num_cpus=16,
            num_gpus=8,
            include_dashboard=False,
            object_store_memory=600 * 1024**2,
            logging_level="WARNING",
            log_to_driver=False,
            runtime_env={"worker_process_setup_hook": SETUP_HOOK},  # as a run's workers (console.py)
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as a float32 HF checkpoint (``python -m scaletrain.models.prepare smollm2``), converted
    once into the scaletrain cache and shared by every test of the session."""
    from scaletrain.models.prepare import prepare_model

    return prepare_model("smollm2")


@pytest.fixture(scope="session")
def task(tmp_path_factory) -> dict:
    """The embedded default's model, tokenizer and arithmetic task, small (400 training problems), built once per
    session for every end-to-end run (tests/trainer/runs.py)."""
    from scaletrain.data import build_embedded_default

    return build_embedded_default(cache_dir=str(tmp_path_factory.mktemp("cache")), n_train=400, n_val=16, n_test=16)
