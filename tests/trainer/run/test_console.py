"""The console and the run log (trainer/run/console.py): libraries' INFO lines go to <run_dir>/run.log and not
to the console, warnings reach both, ``verbose`` shows everything; on the driver and in a Ray worker (real Ray,
real vLLM logging set up as ``vllm.LLM()`` does). Each case runs in a fresh process: the setup owns the root logger.
Also the console logger's step-line spacing."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scaletrain.trainer.run.tracking import Tracking, step_line_every
from scaletrain.utils.gc_tuning import YOUNG_THRESHOLD

ROOT = Path(__file__).resolve().parents[3]

DRIVER = textwrap.dedent(
    """
    import logging, sys
    from scaletrain.trainer.run.console import FILE_ONLY, setup_console, start_run_log

    setup_console(verbose=sys.argv[2] == "1")
    logging.getLogger("scaletrain.probe").info("own info before the run dir is known")
    start_run_log(sys.argv[1])
    logging.getLogger("vllm.engine.probe").info("library info")
    logging.getLogger("ray.probe").warning("library warning")
    logging.getLogger("vllm.renderers.base").warning("Using None for EOS token id because tokenizer is not initialized")
    logging.getLogger("scaletrain.probe").info("own info for the file only", extra=FILE_ONLY)
    """
)

WORKER = textwrap.dedent(
    """
    import gc, os, sys, time
    import ray
    from scaletrain.trainer.run.console import ray_init_kwargs, setup_console, start_run_log

    setup_console(verbose=sys.argv[2] == "1")
    start_run_log(sys.argv[1])
    ray.init(address="local", num_cpus=1, include_dashboard=False, **ray_init_kwargs())

    @ray.remote(num_cpus=1)
    class Worker:
        def speak(self):
            from vllm.config.logging import LoggingConfig
            from vllm.logger import configure_logging, init_logger

            configure_logging(LoggingConfig())  # what vllm.LLM() does when it starts
            log = init_logger("vllm.engine.probe")
            log.info("worker vllm info")
            log.warning("worker vllm warning")
            print("worker raw print", flush=True)
            return os.environ.get("VLLM_CONFIGURE_LOGGING"), gc.get_threshold()[0]

    print("VLLM_CONFIGURE_LOGGING %s young collections every %d" % ray.get(Worker.remote().speak.remote()))
    time.sleep(3)  # Ray forwards the workers' lines to the driver asynchronously
    ray.shutdown()
    """
)


def run_script(script: str, run_dir: Path, verbose: bool) -> tuple[str, str]:
    """(console output, run.log) of ``script`` run with the run directory and the verbosity as arguments."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    out = subprocess.run(
        [sys.executable, "-c", script, str(run_dir), "1" if verbose else "0"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr, (run_dir / "run.log").read_text()


@pytest.mark.parametrize("verbose", [False, True])
def test_driver_library_info_goes_to_the_run_log_only(tmp_path, verbose):
    console, log = run_script(DRIVER, tmp_path, verbose)
    for text in ("own info before", "library info", "library warning", "own info for the file only"):
        assert text in log, text
    assert "own info before the run dir is known" in console
    assert "WARNING ray.probe: library warning" in console
    assert ("library info" in console) == verbose
    assert "for the file only" not in console
    assert "Using None for EOS token id" in log  # an expected warning (console.EXPECTED_WARNINGS)
    assert ("Using None for EOS token id" in console) == verbose


@pytest.mark.slow  # ~20 s: starts Ray and imports vLLM in a worker
@pytest.mark.parametrize("verbose", [False, True])
def test_ray_worker_library_info_goes_to_the_run_log_only(tmp_path, verbose):
    pytest.importorskip("vllm")
    console, log = run_script(WORKER, tmp_path, verbose)
    assert "VLLM_CONFIGURE_LOGGING 0" in console
    # the setup hook's collector settings (utils/gc_tuning.py), set before the worker imported anything
    assert f"young collections every {YOUNG_THRESHOLD}" in console
    assert "Started a local Ray instance" in log and ("Started a local Ray instance" in console) == verbose
    assert "INFO [worker pid" in log and "vllm.engine.probe: worker vllm info" in log
    assert "WARNING vllm.engine.probe: worker vllm warning" in console and "worker vllm warning" in log
    assert ("worker vllm info" in console) == verbose
    assert "worker raw print" in log and "worker raw print" not in console  # a worker's stdout goes to the file


def test_step_line_every_keeps_a_run_near_20_lines():
    assert [step_line_every(n) for n in (None, 10, 20, 150, 700, 1200)] == [1, 1, 1, 10, 50, 100]


def test_console_prints_every_nth_step_the_last_and_validations(tmp_path, capsys):
    with Tracking("proj", "exp", ["console"], tmp_path, total_steps=200) as tracking:  # a line every 10 steps
        for step in range(1, 201):
            metrics = {"critic/score/mean": 0.5}
            if step == 25:
                metrics["val/a/acc"] = 0.75
            tracking.log(metrics, step=step)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == [f"step {s}/200" for s in sorted({*range(10, 201, 10), 25})]
    assert "step 25/200 | score 0.5 | val/a/acc 0.75" in lines
