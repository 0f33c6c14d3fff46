"""Shared seeding helpers: derive_seed's determinism, range and distinctness; vLLM row seeds that never overlap;
one RNG-state format that round-trips through JSON and torch.save and still loads the earlier engine format;
free_port."""

import json
import os
import random
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from backends.rollout.vllm_engine import row_seed
from scaletrain.trainer.run.checkpoint import STATE, CheckpointManager
from scaletrain.utils.net import LOWEST, ephemeral_ports, free_port
from scaletrain.utils.seeding import SEED_BITS, derive_seed, rng_state, set_rng_state


def test_derive_seed_is_deterministic_across_processes():
    here = [derive_seed(7, 3, 1), derive_seed(0), derive_seed(2**40, 5, bits=32)]
    code = (
        "from scaletrain.utils.seeding import derive_seed; "
        "print(derive_seed(7, 3, 1), derive_seed(0), derive_seed(2**40, 5, bits=32))"
    )
    for hash_seed in ("1", "2"):  # a different str-hash salt in each child: hash() would differ, derive_seed not
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert [int(x) for x in out.stdout.split()] == here
    assert derive_seed(7, 3, 1) == derive_seed(np.int64(7), np.int32(3), 1)  # NumPy integers name the same stream


def test_derive_seed_distinct_for_distinct_ids():
    assert derive_seed(1, 2) != derive_seed(2, 1)
    assert derive_seed(12) != derive_seed(1, 2)
    assert derive_seed(1, 2) != derive_seed(1, 2, 0)
    assert derive_seed(-1, 2) != derive_seed(1, 2)
    # the streams the old formulas mixed up: run seed 1's step 0 vs run seed 0's step 100003, seed + epoch
    assert derive_seed(1, 0, 0) != derive_seed(0, 100003, 0)
    assert derive_seed(5, 1) != derive_seed(6, 0)
    grid = [(base, step, gen) for base in range(-3, 20) for step in range(60) for gen in range(3)]
    assert len({derive_seed(*ids) for ids in grid}) == len(grid)
    assert len({derive_seed(base, rank, bits=32) for base in range(200) for rank in range(8)}) == 1600


def test_derive_seed_range():
    seeds = [derive_seed(s, i) for s in range(50) for i in range(20)]
    assert all(0 <= s < 2**SEED_BITS for s in seeds)
    assert max(seeds) > 2 ** (SEED_BITS - 2)  # the range is used, not just its bottom
    assert all(0 <= derive_seed(s, bits=32) < 2**32 for s in range(1000))
    np.random.seed(derive_seed(123, 4, bits=32))  # numpy's legacy seeding takes 32-bit seeds
    assert 0 <= derive_seed(3, bits=1) <= 1 and 0 <= derive_seed(3, bits=64) < 2**64
    for bad in (0, 65):
        with pytest.raises(ValueError, match="bits"):
            derive_seed(1, bits=bad)
    with pytest.raises(TypeError):
        derive_seed(1.5)  # floats would silently alias (1.0 vs 1)


def test_vllm_row_seeds_never_overlap():
    """vLLM seeds sample j of a request with seed + j: every (row, j) of a call needs its own seed."""
    for n in (1, 4, 16):
        sample_seeds = [row_seed(9, row, n) + j for row in range(64) for j in range(n)]
        assert len(set(sample_seeds)) == len(sample_seeds)
        assert max(sample_seeds) < 2**63
    assert row_seed(9, 0, 4) != row_seed(10, 0, 4)


def _draws() -> list:
    return [random.random(), float(np.random.rand()), float(torch.rand(1))]


def test_rng_state_round_trips_through_json_and_torch_save(tmp_path):
    torch.manual_seed(3)
    saved = rng_state()
    expected = _draws()
    for restore in (
        lambda: json.loads(json.dumps(saved)),
        lambda: (torch.save(saved, tmp_path / "s.pt"), torch.load(tmp_path / "s.pt", weights_only=True))[1],
    ):
        _draws()
        set_rng_state(restore())
        assert _draws() == expected


def test_earlier_engine_format_still_loads():
    """Engines used to save tensors / tuples / NumPy arrays (backends/dist.py's former format)."""
    old = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    expected = _draws()
    set_rng_state(old)
    assert _draws() == expected
    with pytest.raises(ValueError, match=r"lacks \['numpy'\]"):
        set_rng_state({"torch": old["torch"], "python": old["python"]})


def test_checkpoint_with_bad_rng_state_names_the_file(tmp_path):
    step_dir = tmp_path / "global_step_1"
    step_dir.mkdir()
    (step_dir / STATE).write_text(json.dumps({"global_step": 1, "rng": {"python": [3, [], None]}}))
    with pytest.raises(ValueError, match=f"{STATE}: cannot restore the driver's RNG state"):
        CheckpointManager.load_state(str(step_dir))


def test_free_port_is_bindable_and_outside_the_range_outgoing_connections_take():
    """Outgoing connections (Ray's many) take ports from the kernel's ephemeral range; a rendezvous port picked
    there could be taken before its rank binds it (EADDRINUSE in init_process_group, seen in the suite)."""
    low, high = ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # random, not the same port for every caller
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
