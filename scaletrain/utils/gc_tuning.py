"""The garbage collector's settings in the project's processes (layer 0).

Starting a worker imports torch, transformers and often vLLM: hundreds of thousands of long-lived objects, and
with Python's default thresholds (a young collection every 700 allocations) the collector runs some 2,000 times
during those imports, the full collections scanning the whole growing heap each time: a quarter of a small
vLLM-rollout run's worker CPU time here. So:

- ``start_process()`` (Ray's ``worker_process_setup_hook`` of every worker process, and the entry points' first
  line) collects young objects every ``YOUNG_THRESHOLD`` allocations instead;
- ``settle()`` (a worker once its classes are imported, an engine before vLLM's own start-up collections) moves
  what exists into the collector's permanent generation (``gc.freeze``): later collections scan only what came
  after. Cycles among frozen objects are never collected; what a process holds once started is meant to stay.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000  # Python's default is 700
SETUP_HOOK = f"{__name__}.start_process"


def start_process() -> None:
    """Fewer young collections for the rest of this process (the older generations' thresholds as they are)."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


def settle() -> None:
    """What this process holds now is taken out of every later collection (``gc.freeze``)."""
    gc.freeze()
