"""A worker imports what its role uses, nothing more: the modules an fsdp actor with the hf rollout and an fsdp
critic load (the worker's, the backend's, the rollout engine's) import neither vLLM nor megatron-core nor DeepSpeed
(each costs seconds per worker process: benchmarks/worker_start.py), and the vllm rollout's module leaves vLLM's
import to the engine's construction. Checked in a fresh interpreter; what the engines import once built is not
covered here."""

import json
import subprocess
import sys

import pytest

from tests.trainer.runs import ROOT, env

HEAVY = ("vllm", "megatron", "deepspeed")
PROBE = """
import json, sys
{imports}
print(json.dumps(sorted(m for m in {heavy} if m in sys.modules)))
"""


def loaded_after(*imports: str) -> list[str]:
    code = PROBE.format(imports="\n".join(imports), heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code], env=env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "imports",
    [
        # the actor worker as an fsdp + hf rollout run builds it: its module, the backend's and the rollout's
        (
            "import scaletrain.workers.actor_rollout_ref",
            "from backends.base import get_backend; get_backend('fsdp')",
            "from backends.rollout.base import get_rollout; get_rollout('hf')",
        ),
        ("import scaletrain.workers.critic", "from backends.base import get_backend; get_backend('fsdp')"),
        # the vllm rollout's class is looked up, not built: vLLM waits for the engine
        (
            "import scaletrain.workers.actor_rollout_ref",
            "from backends.rollout.base import ROLLOUTS; 'vllm' in ROLLOUTS",
        ),
    ],
    ids=["fsdp_actor_hf_rollout", "fsdp_critic", "vllm_rollout_named"],
)
def test_a_worker_imports_only_what_its_role_uses(imports):
    assert loaded_after(*imports) == []
