"""A non-editable install ships both packages and the Hydra configs."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
    assert {"scaletrain/protocol.py", "scaletrain/controller/__init__.py", "backends/__init__.py"} <= names
    assert "scaletrain/configs/__init__.py" in names
    for yaml in (ROOT / "configs").rglob("*.yaml"):
        assert f"scaletrain/configs/{yaml.relative_to(ROOT / 'configs').as_posix()}" in names
