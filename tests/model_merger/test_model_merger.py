"""``python -m scaletrain.model_merger`` on a real run's checkpoints, as a user runs it (a subprocess, no GPU, no
process group): any saved step of the actor, and the critic with its value head, become HF directories that
transformers and vLLM load; ``merge --test`` checks the last step against the run's own HF export. A cut or missing
shard, a checkpoint of another model, the wrong backend or a directory that is no checkpoint fail naming the file
or the flag, and leave nothing at the target (an earlier conversion there stays intact).

The per-backend conversions (FSDP2 and DeepSpeed DP=2, Megatron TP=2, PP=2, TP=2 x PP=2 and DP=2, LoRA adapters
and merged, critics) run inside the engine tests' own ranks: tests/backends/conversion.py and lora_checks.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.trainer.runs import ROOT, env, run_in_process

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(ray_cluster, task, tmp_path_factory):
    """Two steps of a PPO run with a critic (GAE), checkpointed at each, exported to HF at the end."""
    run_dir = tmp_path_factory.mktemp("merger") / "run"
    quiet = ["trainer.val_before_train=false", "data.val_files=null", "trainer.plot_at_end=false"]
    gae = ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1"]
    run_in_process(task, run_dir, 2, [*quiet, *gae])
    return run_dir


def merger(*args: str) -> subprocess.CompletedProcess:
    """The command as a user runs it, in a process of its own."""
    command = [sys.executable, "-m", "scaletrain.model_merger", *map(str, args)]
    return subprocess.run(command, env=env(), cwd=ROOT, capture_output=True, text=True, timeout=300)


def merger_here(*args: str) -> subprocess.CompletedProcess:
    """The same command line through its ``main`` in this process (no interpreter start and imports per call)."""
    from scaletrain.model_merger.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_any_step_converts_and_the_last_equals_the_runs_export(run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    last, first = tmp_path / "step2", tmp_path / "step1"
    out = merger("merge", "--backend", "fsdp", "--local_dir", run / "global_step_2" / "actor", "--target_dir", last,
                 "--test", "--hf_model_path", run / "hf")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"{last} equals {run / 'hf'}" in out.stdout
    out = merger_here("merge", "--local_dir", run / "global_step_1" / "actor", "--target_dir", first)  # auto
    assert out.returncode == 0, out.stderr
    # the run's export and a conversion have the same files besides the weights: config, tokenizer, generation config
    assert set(os.listdir(run / "hf")) == set(os.listdir(last))
    a, b = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (first, last))
    assert any(not torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    tokenizer = AutoTokenizer.from_pretrained(first)
    ids = torch.tensor([tokenizer("12+34=").input_ids])
    assert a.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)
    # a test against another step's model fails, naming the tensors that differ
    out = merger_here("test", "--local_dir", run / "global_step_1" / "actor", "--test_hf_dir", run / "hf")
    assert out.returncode == 1 and "differs from" in out.stderr and "max difference" in out.stderr


def test_the_critic_converts_with_its_value_head(run, tmp_path):
    from transformers import AutoModelForTokenClassification

    target = tmp_path / "critic"
    out = merger_here(
        "merge", "--local_dir", run / "global_step_2" / "critic", "--target_dir", target, "--is-value-model"
    )
    assert out.returncode == 0, out.stderr
    critic = AutoModelForTokenClassification.from_pretrained(target, dtype=torch.float32)
    assert critic.config.num_labels == 1 and critic.score.weight.shape[0] == 1
    out = merger_here("merge", "--local_dir", run / "global_step_2" / "actor", "--target_dir", tmp_path / "x",
                      "--is-value-model")  # fmt: skip
    assert out.returncode == 1 and "--is-value-model" in out.stderr and "causal_lm" in out.stderr


def test_vllm_loads_a_converted_step_and_generates_as_transformers(run, tmp_path):
    pytest.importorskip("vllm")
    target = tmp_path / "step1"
    assert merger_here("merge", "--local_dir", run / "global_step_1" / "actor", "--target_dir", target).returncode == 0
    script = f"""
import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from transformers import AutoTokenizer
from backends.rollout.base import RolloutConfig, SamplingConfig
from backends.rollout.hf import HFRolloutEngine
from backends.rollout.vllm_engine import VLLMRolloutEngine
from tests.backends.conftest import make_prompts
tok = AutoTokenizer.from_pretrained({str(target)!r}, padding_side="left")
config = RolloutConfig(model_path={str(target)!r}, dtype="float32", max_model_len=64, kv_cache_bytes=32 << 20)
prompts = make_prompts(tok, ["12+34=", "7*8=", "100-1="])
greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=6)
ours = VLLMRolloutEngine(config, tok).generate(prompts, greedy).batch["responses"]
theirs = HFRolloutEngine(config, tok).generate(prompts, greedy).batch["responses"]
assert ours.tolist() == theirs.tolist(), (ours, theirs)
print("same greedy responses", ours.tolist())
"""
    out = subprocess.run([sys.executable, "-c", script], env=env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0 and "same greedy responses" in out.stdout, out.stderr[-3000:]


def test_a_cut_or_missing_shard_or_another_model_fails_naming_it(run, tmp_path):
    from transformers import AutoConfig

    target = tmp_path / "out"
    assert merger_here("merge", "--local_dir", run / "global_step_2" / "actor", "--target_dir", target).returncode == 0
    before = sorted(os.listdir(target))

    def broken(name: str):
        ckpt = tmp_path / name
        shutil.copytree(run / "global_step_2" / "actor", ckpt)
        return ckpt

    def refused(ckpt, *flags) -> str:
        out = merger_here("merge", "--local_dir", ckpt, "--target_dir", target, *flags)
        assert out.returncode == 1, out.stdout
        assert sorted(os.listdir(target)) == before and not (tmp_path / "out.incomplete").exists()
        return out.stderr

    cut = broken("cut")
    shard = sorted((cut / "dcp").glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:1000])  # a copy interrupted early (one cut past the model's bytes, in
    # the optimizer state a conversion does not read, would convert correctly)
    assert f"{shard}: cut at" in refused(cut)
    missing = broken("missing")
    gone = sorted((missing / "dcp").glob("*.distcp"))[0]
    gone.unlink()
    assert f"{gone} not found" in refused(missing)
    other = broken("other_model")
    config = AutoConfig.from_pretrained(other / "huggingface")
    config.intermediate_size *= 2  # another model's config next to these weights
    config.save_pretrained(other / "huggingface")
    error = refused(other)
    assert "has shape" in error and str(other) in error
    assert "written by the fsdp backend, not megatron" in refused(
        run / "global_step_2" / "actor", "--backend", "megatron"
    )
    assert "scaletrain_checkpoint.json not found" in refused(run)
    assert "nothing is uploaded" in refused(run / "global_step_2" / "actor", "--hf_upload_path", "me/model")
    meta = json.loads((run / "global_step_2" / "actor" / "scaletrain_checkpoint.json").read_text())
    assert meta["backend"] == "fsdp" and meta["layout"] == {"dp": 2} and meta["kind"] == "causal_lm"
