"""Checkpoints are never lost (issue 16, items 4 and 7), on a real filesystem with real processes:
- ``kill -9`` of a process saving checkpoints in a loop, at seeded random moments (most land mid-save), and placed
  by strace on each rename and mid-deletion (slow, both): ``latest()`` is always a complete checkpoint whose files
  are all from one save, keep-N never leaves none, a new save succeeds;
- every file of a save and its directories are fsync'd before the rename, the root after it (seen with strace);
- a full disk (a 2 MiB tmpfs, or RLIMIT_FSIZE in a child) fails the save with an error naming the directory and
  leaves the previous checkpoint loadable; an HF export failing midway leaves the previous one, nothing partial;
- per-rank files load with ``weights_only=True``: old NumPy RNG states still load, pickled code is refused; so
  does the allow-list unpickler of DCP's metadata (each engine's own checkpoint, tampered, is refused by its
  ``tampered_checkpoint_refused`` check in tests/backends/).
Run as ``python -m tests.faults.test_checkpoint_faults <mode> ...``, this module is the child of those tests.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from backends.checkpoint.hf_export import write_hf_checkpoint
from backends.checkpoint.safe_load import UnsafeCheckpointError, load_pickle_allowing, load_rank_file
from scaletrain.trainer.run.checkpoint import POINTER, CheckpointManager

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NFILES, FILE_BYTES, KEEP = 3, 4 << 20, 2
LEFTOVER = re.compile(r"^\.global_step_\d+\.(incomplete|replaced|deleting)$")


# --------------------------------------------------------------------------------------------- workers' files
def _content(step: int, run: int, i: int, size: int) -> bytes:
    header = f"{step} {run} {i} {size}\n".encode()
    return header + hashlib.sha256(header).digest() * (size // 32)


def _write_shards(path: str, step: int, run: int, pause: float = 0.0, size: int = FILE_BYTES) -> None:
    """What the workers write: NFILES files of ``size`` bytes under actor/, each naming its save; 1 MiB per write
    call, then ``pause`` seconds (a slow shared filesystem: kills then land mostly while a save is writing)."""
    os.makedirs(os.path.join(path, "actor"))
    for i in range(NFILES):
        data = _content(step, run, i, size)
        with open(os.path.join(path, "actor", f"shard{i}.bin"), "wb") as f:
            for start in range(0, len(data), 1 << 20):
                f.write(data[start : start + (1 << 20)])
                time.sleep(pause)


def _check_consistent(path: str) -> tuple[int, int]:
    """The (step, run) of a checkpoint whose every file is complete and from that one save."""
    state = CheckpointManager.load_state(path)
    step, run = state["global_step"], state["run"]
    assert os.path.basename(path) == f"global_step_{step}"
    assert sorted(os.listdir(os.path.join(path, "actor"))) == [f"shard{i}.bin" for i in range(NFILES)]
    for i in range(NFILES):
        with open(os.path.join(path, "actor", f"shard{i}.bin"), "rb") as f:
            data = f.read()
        size = int(data.split(b"\n", 1)[0].split()[3])
        assert data == _content(step, run, i, size), f"{path}/actor/shard{i}.bin is not all from step {step} run {run}"
    return step, run


def _check_after_kill(root: str, allowed: set, new_run: int) -> tuple[int, int]:
    """After a kill: the latest checkpoint is one of ``allowed`` (step, run), every complete-looking checkpoint is
    complete, keep-N left at least one; then a new save succeeds and clears what the killed process left."""
    manager = CheckpointManager(root, KEEP)
    latest = manager.latest()
    assert latest is not None and _check_consistent(latest) in allowed, (latest, allowed, os.listdir(root))
    assert 1 <= len(manager.saved_steps()) <= KEEP + 1, sorted(manager.saved_steps())
    for other in manager.saved_steps():  # not only the latest: a complete-looking directory is complete
        _check_consistent(manager.step_dir(other))
    step = _check_consistent(latest)[0] + 1
    manager.save(step, lambda path: _write_shards(path, step, new_run, size=64 << 10), {"run": new_run})
    assert _check_consistent(manager.latest()) == (step, new_run)
    assert not [n for n in os.listdir(root) if LEFTOVER.match(n)], os.listdir(root)
    assert len(manager.saved_steps()) <= KEEP
    return step, new_run


# --seccomp-bpf: only the traced calls stop the child (without it every syscall does, and a child's imports take
# 8 s instead of 2.4 s); -f follows its threads and processes. (strace 6.1 does not inject under --seccomp-bpf:
# the kill test attaches to a ready child instead, _traced_saver.)
STRACE = ["strace", "-f", "--seccomp-bpf"]


def _child(*args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    cmd = [*kwargs.pop("prefix", []), sys.executable, "-m", "tests.faults.test_checkpoint_faults", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, **kwargs)


def _saver_main(root: str, run: int, pause: float, size: int, saves: int, wait: bool = False) -> None:
    """``saves`` saves (0: forever), the first re-saving the latest step (so kills also hit the replace of a step);
    ``wait``: after "ready", a line on stdin first."""
    manager = CheckpointManager(root, KEEP)
    latest = manager.latest()
    first = CheckpointManager.load_state(latest)["global_step"] if latest else 1
    print("ready", flush=True)
    if wait:
        sys.stdin.readline()
    for step in range(first, first + saves) if saves else itertools.count(first):
        print(f"begin {step}", flush=True)
        manager.save(step, lambda path, s=step: _write_shards(path, s, run, pause, size), {"run": run})
        print(f"saved {step}", flush=True)


def _allowed(events: list[str], last_saved: tuple[int, int] | None, run: int) -> set:
    """What ``latest()`` may be after a kill: the last save that returned, or the one under way (after its rename)."""
    events = [e for e in events if e.split()[0] in ("begin", "saved")]
    kind, step = events[-1].split() if events else ("none", "0")
    return {(int(step), run)} if kind == "saved" else {last_saved, (int(step), run)}


# ----------------------------------------------------------------------------------------------------- kill -9
@pytest.mark.slow  # 10 child processes, ~20 s
def test_kill_9_at_random_moments_never_loses_a_checkpoint(tmp_path):
    root, rnd = str(tmp_path / "ckpt"), random.Random(16)
    last_saved: tuple[int, int] | None = None  # (step, run) of the last save that returned
    mid_write, seen = 0, []
    for trial in range(10):
        proc = _child("saver", root, str(trial), "0.005" if trial % 2 else "0", str(FILE_BYTES), "0")  # odd: slow
        assert proc.stdout.readline() == b"ready\n"
        time.sleep(rnd.uniform(0.05, 0.8))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        events = proc.stdout.read().decode().split("\n")[:-1]
        leftovers = [n for n in os.listdir(root) if LEFTOVER.match(n)] if os.path.isdir(root) else []
        mid_write += any(n.endswith(".incomplete") for n in leftovers)
        seen += leftovers
        saved = [int(e.split()[1]) for e in events if e.startswith("saved")]
        last_saved = (saved[-1], trial) if saved else last_saved
        if last_saved is None and CheckpointManager(root).latest() is None:
            continue  # killed before the first save finished: nothing to check yet
        last_saved = _check_after_kill(root, _allowed(events, last_saved, trial), 100 + trial)
    print(f"{mid_write} of 10 kills landed while a save was writing; last step {last_saved[0]}; left: {seen}")
    assert mid_write >= 4, f"only {mid_write} of 10 kills landed while a save was writing"


def _kill_points(trace: str, root: str) -> list[tuple[str, int]]:
    """(syscall, k): the k-th calls in ``trace`` from the first one naming ``root`` on; every other ``unlinkat``
    only (the deletions are of similar files, and each kill costs a process start)."""
    points, counts, started = [], {}, False
    with open(trace) as f:
        for line in f:
            if not (match := re.match(r"^\d+ +(\w+)\(", line)):
                continue
            name = match.group(1)
            counts[name] = counts.get(name, 0) + 1
            started = started or root in line
            if started and (name != "unlinkat" or counts[name] % 2):
                points.append((name, counts[name]))
    return points


def _traced_saver(root: str, saver: tuple[str, ...], *strace_args: str) -> tuple[int, list[str]]:
    """The saver child with strace attached once its imports are done, run to its end: its exit status and its
    stdout lines after "ready". The kill points count the save's calls alone, and the imports run untraced
    (traced, a child's imports took ~8 s instead of ~2.4 s). Returns once strace has exited too, so its output
    file is complete."""
    proc = _child("saver", root, *saver, "wait", stdin=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    tracer = subprocess.Popen(
        ["strace", "-f", "-p", str(proc.pid), *strace_args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    attached = tracer.stderr.readline()  # "strace: Process N attached with M threads", once all are
    if b"attached" not in attached:
        proc.kill()
        pytest.skip(f"strace could not attach to a child here: {attached.decode().strip()}")
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    events = proc.communicate(timeout=120)[0].decode().split("\n")[:-1]
    tracer.communicate(timeout=60)
    return proc.returncode, events


@pytest.mark.slow  # 14 child processes, ~35 s
def test_kill_9_at_every_rename_and_unlink_of_a_save(tmp_path):
    """strace kills the saving process (SIGKILL) on entering its k-th rename / unlinkat / rmdir: at each rename of
    a save (the replace of an existing step, the pointer's replace, a prune) and mid-way through deleting the
    replaced and the pruned checkpoints, where a random kill rarely lands."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    template = str(tmp_path / "template")
    for step in (1, 2):
        writer = functools.partial(_write_shards, step=step, run=0, size=64 << 10)
        CheckpointManager(template, KEEP).save(step, writer, {"run": 0})
    saver = ("1", "0", str(64 << 10), "2")  # run 1, no pause, 64 KiB files, 2 saves: re-save step 2, then step 3
    root, trace = str(tmp_path / "dry"), str(tmp_path / "trace")
    shutil.copytree(template, root)
    watched = "trace=rename,renameat,renameat2,unlinkat,rmdir"
    status, _ = _traced_saver(root, saver, "-o", trace, "-e", watched)
    assert status == 0
    kills = _kill_points(trace, template.replace("template", "dry"))
    assert len(kills) >= 13, kills  # 2 saves: 6 renames, 2 directory deletions of 6 entries each
    for name, k in kills:
        root = str(tmp_path / f"{name}{k}")
        shutil.copytree(template, root)
        inject = ["-o", "/dev/null", "-e", f"trace={name}", "-e", f"inject={name}:signal=KILL:when={k}"]
        status, events = _traced_saver(root, saver, *inject)  # SIGKILL on entering that call
        assert status == -signal.SIGKILL, (name, k, status, events)
        _check_after_kill(root, _allowed(events, (2, 0) if "saved 2" not in events else (2, 1), 1), 9)
        shutil.rmtree(root)


def test_prune_removes_only_old_checkpoints_and_leftovers_of_earlier_steps(tmp_path):
    root, manager = str(tmp_path), CheckpointManager(str(tmp_path), max_to_keep=1)
    for step in (1, 2):
        manager.save(step, functools.partial(_write_shards, step=step, run=0, size=1024), {"run": 0})
    others = ["global_step_7", "notes", ".global_step_9.incomplete"]  # not a checkpoint (no state); a later step's
    for name in [*others, ".global_step_2.incomplete", ".global_step_1.deleting"]:
        os.makedirs(os.path.join(root, name))
    manager.save(3, functools.partial(_write_shards, step=3, run=0, size=1024), {"run": 0})
    assert sorted(os.listdir(root)) == sorted(["global_step_3", POINTER, *others])


# ---------------------------------------------------------------------------------------------------- fsync
def test_save_fsyncs_every_file_and_directory_before_the_rename(tmp_path):
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    root, trace = str(tmp_path / "ckpt"), str(tmp_path / "trace")
    proc = _child("save_once", root, prefix=[*STRACE, "-y", "-o", trace, "-e", "trace=fsync,%file"])
    proc.communicate(timeout=120)
    if proc.returncode != 0:
        pytest.skip(f"strace could not trace a child here (exit {proc.returncode})")
    with open(trace) as f:
        lines = f.read().splitlines()
    tmp, final = os.path.join(root, ".global_step_1.incomplete"), os.path.join(root, "global_step_1")
    fsync = re.compile(r"fsync\(\d+<([^>]*)>\) = 0")

    def synced(part: list[str]) -> set[str]:
        return {m.group(1) for m in map(fsync.search, part) if m}

    def renamed_to(path: str) -> int:
        return next(i for i, line in enumerate(lines) if "rename" in line and f'"{path}"' in line)

    rename, pointer = renamed_to(final), renamed_to(os.path.join(root, POINTER))
    expected = {tmp, os.path.join(tmp, "actor")}
    for dirpath, _, files in os.walk(final):
        expected.update(os.path.join(dirpath.replace(final, tmp, 1), name) for name in files)
    assert len(expected) == NFILES + 3  # the shards, trainer_state.json and the two directories
    assert expected <= synced(lines[:rename]), f"not fsync'd before the rename: {sorted(expected - synced(lines))}"
    assert root in synced(lines[rename:pointer]), "the root directory is not fsync'd after the rename"
    assert root in synced(lines[pointer:]), "the root directory is not fsync'd after the pointer's replace"


# ------------------------------------------------------------------------------------------------ disk full
def _disk_full_main(root: str) -> dict:
    """A small save, then failing saves of a new step and of the same step; the facts, for the parent to check."""
    manager = CheckpointManager(root, max_to_keep=2)
    small = torch.arange(1000, dtype=torch.float32)
    manager.save(1, lambda p: torch.save({"w": small}, os.path.join(p, "w.pt")), {"run": "small"})
    with open(os.path.join(root, POINTER)) as f:
        pointer = f.read()

    def torch_big(path: str) -> None:
        torch.save({"w": torch.ones(1 << 20)}, os.path.join(path, "w.pt"))  # 4 MiB

    def plain_big(path: str) -> None:
        with open(os.path.join(path, "w.bin"), "wb") as f:
            f.write(b"x" * (4 << 20))
            f.flush()

    errors = []
    for step, writer in ((2, torch_big), (2, plain_big), (1, plain_big)):
        try:
            manager.save(step, writer, {"run": "big"})
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    latest = manager.latest()
    facts = {"errors": errors, "latest": latest, "entries": sorted(os.listdir(root))}
    facts["run"] = CheckpointManager.load_state(latest)["run"]
    facts["weights_equal"] = bool(torch.equal(load_rank_file(os.path.join(latest, "w.pt"))["w"], small))
    with open(os.path.join(root, POINTER)) as f:
        facts["pointer_kept"] = f.read() == pointer
    manager.save(2, lambda p: torch.save({"w": small}, os.path.join(p, "w.pt")), {"run": "after"})
    facts["after"] = manager.latest()
    return facts


def _tmpfs(path: str, size: str) -> bool:
    os.makedirs(path)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True)
    return done.returncode == 0


@pytest.mark.parametrize("mechanism", ["tmpfs", "rlimit_fsize"])
def test_disk_full_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path, mechanism):
    root = str(tmp_path / "small")
    if mechanism == "tmpfs":
        if not _tmpfs(root, "2m"):
            pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN); the rlimit_fsize case covers it")
        try:
            facts, reason = _disk_full_main(root), "No space left on device"
        finally:
            subprocess.run(["umount", root], check=True)
    else:
        proc = _child("disk_full", root)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        facts, reason = json.loads(out.decode().splitlines()[-1]), "File too large"
    step1, step2 = os.path.join(root, "global_step_1"), os.path.join(root, "global_step_2")
    for message, path in zip(facts["errors"], (step2, step2, step1)):
        assert message is not None and f"checkpoint save of step {path[-1]} to {path} failed" in message, message
        assert f"the previous checkpoint {step1} is intact" in message and "MiB were free on" in message, message
    assert reason in facts["errors"][1] and reason in facts["errors"][2], facts["errors"]
    assert facts["latest"] == step1 and facts["run"] == "small" and facts["weights_equal"] and facts["pointer_kept"]
    assert facts["entries"] == ["global_step_1", POINTER], facts["entries"]  # no incomplete directory left
    assert facts["after"] == step2  # the space came back: the incomplete directories were removed


# ------------------------------------------------------------------------------------------------ HF export
def _hf_buckets(model, fail_after: int | None = None, extra: torch.Tensor | None = None):
    items = [(k, v) for k, v in model.state_dict().items() if k != "lm_head.weight"]  # tied to the embeddings
    buckets = [items[i : i + 4] for i in range(0, len(items), 4)]
    if extra is not None:
        buckets.insert(1, [("extra.weight", extra)])
    for i, bucket in enumerate(buckets):
        if fail_after is not None and i == fail_after:
            raise RuntimeError("gather failed on a peer")
        yield bucket


def _export(path: str, buckets, model, tokenizer_dir: str) -> None:
    write_hf_checkpoint(path, buckets, model.config, "Qwen2ForCausalLM", True, model.generation_config, tokenizer_dir)


def _assert_export_is(path: str, model, others: tuple[str, ...] = ()) -> None:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    parent, name = os.path.split(path)
    assert sorted(os.listdir(parent)) == sorted({name, *others}), os.listdir(parent)  # nothing partial left


def _tiny_models(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.backends.tiny import save_tiny_qwen2

    src = save_tiny_qwen2(str(tmp_path / "src"), seed=0)
    first = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    torch.manual_seed(1)
    second = type(first)(first.config)
    return src, first, second


def test_hf_export_failing_midway_keeps_the_previous_export(tmp_path):
    src, first, second = _tiny_models(tmp_path)
    path = str(tmp_path / "hf")
    _export(path, _hf_buckets(first), first, src)
    _assert_export_is(path, first, ("src",))
    with pytest.raises(RuntimeError, match=f"HF export to {path} failed.*gather failed.*previous export {path} is"):
        _export(path, _hf_buckets(second, fail_after=1), second, src)
    _assert_export_is(path, first, ("src",))
    _export(path, _hf_buckets(second), second, src)  # a complete export replaces the old one
    _assert_export_is(path, second, ("src",))


def test_hf_export_disk_full_drains_the_buckets_and_keeps_the_previous_export(tmp_path):
    src, first, second = _tiny_models(tmp_path)
    small = str(tmp_path / "small")
    if not _tmpfs(small, "1m"):
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    try:
        path = os.path.join(small, "hf")
        _export(path, _hf_buckets(first), first, src)
        drawn = []
        buckets = (drawn.append(b) or b for b in _hf_buckets(second, extra=torch.ones(1 << 18)))  # 1 MiB: too big
        with pytest.raises(RuntimeError, match=f"HF export to {path} failed.*No space left on device"):
            _export(path, buckets, second, src)
        assert len(drawn) == len(list(_hf_buckets(second))) + 1  # drawn to the end: the peers' gathers complete
        _assert_export_is(path, first)
    finally:
        subprocess.run(["umount", small], check=True)


# -------------------------------------------------------------------------------------------- weights_only
def _payload(marker: str):
    class Payload:
        def __reduce__(self):
            return (os.makedirs, (marker,))  # what a malicious checkpoint would run on a full unpickle

    return Payload()


def test_rank_files_load_weights_only(tmp_path):
    from scaletrain.utils.seeding import rng_state, set_rng_state

    current = str(tmp_path / "current.pt")
    scheduler = {"base_lrs": [0.1], "lr_lambdas": [None]}  # LambdaLR's state_dict: no functions in it
    torch.save({"rng": rng_state(), "scheduler": scheduler, "w": torch.ones(3)}, current)
    assert load_rank_file(current)["scheduler"]["base_lrs"] == [0.1]
    legacy = str(tmp_path / "legacy.pt")  # the engines' RNG format before it was unified: NumPy array, tuples
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save({"rng": old}, legacy)
    set_rng_state(load_rank_file(legacy)["rng"])
    evil, marker = str(tmp_path / "evil.pt"), str(tmp_path / "ran")
    torch.save({"rng": _payload(marker)}, evil)
    with pytest.raises(RuntimeError, match=rf"{re.escape(evil)}: refusing to load the object \S*makedirs"):
        load_rank_file(evil)
    assert not os.path.exists(marker)


def test_allow_list_unpickler_resolves_only_what_it_is_told(tmp_path):
    import io
    import pickle

    marker = str(tmp_path / "ran")
    allowed = {("torch", "Size")}.__contains__
    sizes = {"a": torch.Size([2, 3])}
    assert load_pickle_allowing(io.BytesIO(pickle.dumps(sizes)), lambda m, n: allowed((m, n)), "x") == sizes
    for payload in (_payload(marker), {"nested": [_payload(marker)]}):
        with pytest.raises(UnsafeCheckpointError, match=r"where\.pkl: refusing to load the object os\.makedirs"):
            load_pickle_allowing(io.BytesIO(pickle.dumps(payload)), lambda m, n: allowed((m, n)), "where.pkl")
    assert not os.path.exists(marker)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "saver":
        _saver_main(args[0], int(args[1]), float(args[2]), int(args[3]), int(args[4]), args[5:] == ["wait"])
    elif mode == "save_once":
        CheckpointManager(args[0], KEEP).save(1, lambda path: _write_shards(path, 1, 0, size=64 << 10), {"run": 0})
    elif mode == "disk_full":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        print(json.dumps(_disk_full_main(args[0])))
