"""Seeds and RNG states shared by every layer: ``derive_seed`` names one random stream by a tuple of integers
(run seed, step, rank, row, ...), and ``rng_state`` / ``set_rng_state`` capture and restore a process's global RNGs
for checkpoints (the trainer's JSON state and the engines' per-rank files use the same format)."""

from __future__ import annotations

import hashlib
import operator
import random
from typing import Any

import numpy as np
import torch

# Default width of a derived seed. vLLM seeds sample j of a request with seed + j and keeps seeds in int64, so a
# 62-bit seed leaves room for those offsets (and for backends/rollout/vllm_engine.py's row spacing).
SEED_BITS = 62


def derive_seed(base: int, *ids: int, bits: int = SEED_BITS) -> int:
    """The seed of the stream named by ``(base, *ids)``, in [0, 2**bits); the same on every process and run.

    Use ``bits=32`` for seeds that reach ``numpy.random.seed`` (which refuses 2**32 and above), e.g. vLLM's
    engine seed.

    Collisions: the key ``"base,id1,id2,..."`` is a different string for every different tuple (decimal integers
    between commas parse back uniquely, so (1, 2), (2, 1) and (12,) all differ), and blake2b maps different keys
    to independent, uniformly distributed digests. Two given tuples therefore share a seed with probability
    2**-bits, and any collision among k seeds of a run has probability below k**2 / 2**(bits + 1): at 62 bits,
    about 1e-7 for a million seeds. Python's ``hash()`` is not used: it is salted per process.
    """
    if not 1 <= bits <= 64:
        raise ValueError(f"bits must be in [1, 64], got {bits}")
    key = ",".join(str(operator.index(x)) for x in (base, *ids)).encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - bits)


def rng_state() -> dict[str, Any]:
    """This process's RNG states (Python, NumPy, torch CPU and, when available, CUDA) as plain lists and numbers,
    so the same dict can go into JSON or ``torch.save``; a resumed run then draws the same random numbers."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # the legacy form, get_state's default (its stub also allows a dict)
    kind, keys, pos, has_gauss, cached = np_state
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` captured. Also accepts the earlier engine format (tensors, tuples and NumPy
    arrays instead of lists), so checkpoints written before the formats were unified still resume."""
    missing = {"python", "numpy", "torch"} - set(state)
    if missing:
        raise ValueError(f"RNG state lacks {sorted(missing)} (has {sorted(state)})")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.as_tensor(state["cuda"], dtype=torch.uint8))
