"""The collector's settings (scaletrain/utils/gc_tuning.py) in a fresh process, as a Ray worker meets them: the
setup hook's threshold, then a Worker's start freezing what its imports made."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import gc
    from scaletrain.utils.gc_tuning import start_process
    default = gc.get_threshold()[0]
    start_process()  # what Ray's setup hook runs first in a worker process
    import torch  # a worker's imports
    from scaletrain.controller.worker import Worker
    before = gc.get_freeze_count()
    Worker()
    print(default, gc.get_threshold()[0], before, gc.get_freeze_count())
    """
)


def test_a_worker_process_collects_less_often_and_its_start_freezes_the_imported_heap():
    from scaletrain.utils.gc_tuning import YOUNG_THRESHOLD

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    default, young, before, frozen = map(int, out.stdout.split())
    assert default == 700 and young == YOUNG_THRESHOLD
    assert before == 0 and frozen > 100_000  # torch's modules and objects, out of every later collection
