"""The rollout engine's lifecycle (backends/rollout/lifecycle.py), the colocated worker's mode switches
(scaletrain/workers/colocated_rollout.py) and the vLLM settings mapping (backends/rollout/vllm_engine.py).

The states are real on CPU (the memory release is a no-op there), so the orders a GPU run takes are checked here:
with a recording engine, with the real vLLM engine, and for the calls the vLLM engine makes into ``vllm.LLM``'s
sleep mode (which exists only on CUDA, so that ``LLM`` object is the one thing replaced by a recorder).
"""

from __future__ import annotations

import threading

import pytest
import torch

from backends.config import EngineConfig, ModelConfig, resolve_precision
from backends.rollout.base import RolloutConfig, SamplingConfig
from backends.rollout.lifecycle import EngineLifecycle, EngineState, IllegalTransition
from scaletrain.workers.colocated_rollout import ColocatedRollout


class RecordingEngine:
    """A rollout engine that records the memory calls made on it, and what the trainer held meanwhile."""

    def __init__(self, log: list):
        self.log = log

    def sleep(self):
        self.log.append("engine.sleep")

    def wake_up(self, tags=("weights", "kv_cache")):
        self.log.append(f"engine.wake:{'+'.join(tags)}")

    def update_weights(self, buckets):
        for bucket in buckets:
            self.log.append(f"engine.update:{len(bucket)}")

    def generate(self, prompts, sampling):
        self.log.append("engine.generate")
        return prompts


class RecordingTrainer:
    def __init__(self, log: list):
        self.log, self.on_device = log, True

    def offload(self):
        self.on_device = False
        self.log.append("trainer.offload")

    def onload(self):
        self.on_device = True
        self.log.append("trainer.onload")

    def export_weights(self, bucket_bytes):
        assert self.on_device, "the trainer exports its weights from the device"
        self.log.append("trainer.export")
        yield [("w", torch.zeros(2))]


# ----------------------------------------------------------------------------------------- state machine
def test_legal_cycle_and_history():
    log = []
    lc = EngineLifecycle(RecordingEngine(log))
    assert lc.state is EngineState.SERVING
    lc.require("generate")
    lc.sleep()
    lc.wake_weights()
    lc.require("update_weights")
    lc.wake_kv_cache()
    lc.require("generate")
    assert lc.history == ["sleep", "wake_weights", "wake_kv_cache"]
    assert log == ["engine.sleep", "engine.wake:weights", "engine.wake:kv_cache"]


@pytest.mark.parametrize(
    "moves, bad, message",
    [
        ([], "wake_weights", "cannot wake_weights while serving; legal now: sleep"),
        (["sleep"], "wake_kv_cache", "cannot wake_kv_cache while sleeping; legal now: wake_weights"),
        (["sleep"], "sleep", "cannot sleep while sleeping"),
        (["sleep", "wake_weights"], "wake_weights", "cannot wake_weights while weights"),
    ],
)
def test_illegal_moves_are_refused_and_change_nothing(moves, bad, message):
    log = []
    lc = EngineLifecycle(RecordingEngine(log))
    for move in moves:
        getattr(lc, move)()
    state, calls = lc.state, list(log)
    with pytest.raises(IllegalTransition, match=message):
        getattr(lc, bad)()
    assert lc.state is state and log == calls


def test_calls_need_their_states():
    lc = EngineLifecycle(RecordingEngine([]))
    lc.sleep()
    with pytest.raises(IllegalTransition, match=r"update_weights\(\) needs state weights or serving, it is sleeping"):
        lc.require("update_weights")
    with pytest.raises(IllegalTransition, match=r"generate\(\) needs state serving, it is sleeping"):
        lc.require("generate")
    lc.wake_weights()
    with pytest.raises(IllegalTransition, match=r"generate\(\) needs state serving, it is weights"):
        lc.require("generate")


# ------------------------------------------------------------------------------------------- the worker's modes
def colocated(log, free_cache_engine=True, offload_trainer=True):
    return ColocatedRollout(
        RecordingEngine(log),
        RecordingTrainer(log),
        free_cache_engine=free_cache_engine,
        offload_trainer=offload_trainer,
        bucket_bytes=1 << 20,
    )


def test_sync_wakes_weights_updates_then_offloads_and_wakes_kv_cache():
    log = []
    c = colocated(log)
    c.release()  # after init: training mode
    c.push_weights()  # after an update
    assert log == [
        "engine.sleep",
        "engine.wake:weights",
        "trainer.export",
        "engine.update:1",
        "trainer.offload",
        "engine.wake:kv_cache",
    ]
    log.clear()
    c.generate(None, SamplingConfig())  # already serving: nothing to wake
    c.generate(None, SamplingConfig())  # a second flush keeps it awake
    c.release()  # training needs the memory
    assert log == ["engine.generate", "engine.generate", "engine.sleep", "trainer.onload"]


def test_generate_from_training_mode_and_push_from_rollout_mode():
    log = []
    c = colocated(log)
    c.release()
    log.clear()
    c.generate(None, SamplingConfig())
    assert log == ["engine.wake:weights", "trainer.offload", "engine.wake:kv_cache", "engine.generate"]
    log.clear()
    c.push_weights()  # the trainer comes back to export; the engine stays awake
    assert log == ["trainer.onload", "trainer.export", "engine.update:1", "trainer.offload"]
    assert c.lifecycle.state is EngineState.SERVING


def test_free_cache_engine_false_never_sleeps():
    log = []
    c = colocated(log, free_cache_engine=False, offload_trainer=False)
    c.release()
    c.generate(None, SamplingConfig())
    c.release()
    c.push_weights()
    assert log == ["engine.generate", "trainer.export", "engine.update:1"]
    assert c.lifecycle.history == []


class SlowPipeline:
    """A trainer whose export of bucket 1 must begin while the engine still loads bucket 0: the engine's load of
    bucket 0 waits (bounded) for the export's start of bucket 1, which a serial push would never reach."""

    def __init__(self):
        self.second_gathering = threading.Event()
        self.overlapped = False
        self.loaded = []

    def export_weights(self, bucket_bytes):
        yield [("w0", torch.zeros(2))]
        self.second_gathering.set()
        yield [("w1", torch.ones(3))]

    def update_weights(self, buckets):
        for i, bucket in enumerate(buckets):
            if i == 0:
                self.overlapped = self.second_gathering.wait(timeout=10)
            self.loaded.append([name for name, _ in bucket])

    def sleep(self):
        pass

    def wake_up(self, tags=("weights", "kv_cache")):
        pass


def test_the_next_bucket_is_gathered_while_the_engine_loads_the_previous():
    pipeline = SlowPipeline()
    c = ColocatedRollout(pipeline, pipeline, free_cache_engine=False, offload_trainer=False, bucket_bytes=1)
    assert c.push_weights() == 5 * 4  # float32 bytes of both buckets, counted as loaded
    assert pipeline.overlapped and pipeline.loaded == [["w0"], ["w1"]]


def test_push_without_trainer_is_refused():
    c = ColocatedRollout(RecordingEngine([]), None, free_cache_engine=True, offload_trainer=True, bucket_bytes=1)
    with pytest.raises(RuntimeError, match="no training engine"):
        c.push_weights()


# ------------------------------------------------------------------------------------------- the real engine
def test_vllm_engine_through_the_lifecycle(vllm_engine, rollout_model_dir, prompts):
    from tests.backends.rollout.test_rollout_vllm import GREEDY, assert_same_rollout, checkpoint_buckets

    before = vllm_engine.generate(prompts, GREEDY)
    lc = EngineLifecycle(vllm_engine)
    lc.sleep()
    with pytest.raises(IllegalTransition):
        lc.require("update_weights")
    lc.wake_weights()
    lc.require("update_weights")
    vllm_engine.update_weights(checkpoint_buckets(rollout_model_dir))
    with pytest.raises(IllegalTransition):
        lc.require("generate")
    lc.wake_kv_cache()
    assert_same_rollout(vllm_engine.generate(prompts, GREEDY), before, atol=1e-6)


class RecordingLLM:
    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


def test_vllm_engine_uses_sleep_mode_where_supported():
    pytest.importorskip("vllm")
    from backends.rollout.vllm_engine import VLLMRolloutEngine

    engine = object.__new__(VLLMRolloutEngine)  # vLLM's sleep mode exists on CUDA only: record the calls
    engine.llm, engine.sleep_supported = RecordingLLM(), True
    lc = EngineLifecycle(engine)
    lc.sleep()
    lc.wake_weights()
    lc.wake_kv_cache()
    assert engine.llm.calls == [("sleep", 1), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
    engine.llm, engine.sleep_supported = RecordingLLM(), False  # CPU, or enable_sleep_mode=false
    engine.sleep()
    engine.wake_up()
    assert engine.llm.calls == []


# ------------------------------------------------------------------------------------------------ settings
def test_llm_arguments_by_device():
    from backends.rollout.vllm_engine import llm_arguments

    config = RolloutConfig(
        model_path="m", max_model_len=300, max_num_batched_tokens=256, engine_kwargs={"vllm": {"swap_space": 2}}
    )
    cpu, cuda = llm_arguments(config, "cpu", False), llm_arguments(config, "cuda", True)
    assert (cpu["dtype"], cpu["enforce_eager"], cpu["enable_chunked_prefill"]) == ("float32", True, False)
    assert cpu["kv_cache_memory_bytes"] == 64 << 20
    assert (cuda["dtype"], cuda["enforce_eager"], cuda["enable_chunked_prefill"]) == ("bfloat16", False, True)
    assert "kv_cache_memory_bytes" not in cuda and cuda["gpu_memory_utilization"] == 0.5
    assert cuda["enable_sleep_mode"] and not cpu["enable_sleep_mode"]
    assert cpu["max_num_batched_tokens"] == 300  # at least one whole sequence without chunked prefill
    assert cpu["swap_space"] == cuda["swap_space"] == 2
    explicit = RolloutConfig(
        model_path="m",
        dtype="float16",
        kv_cache_bytes=1 << 30,
        enforce_eager=True,
        load_format="dummy",
        max_num_seqs=7,
        enable_prefix_caching=False,
    )
    args = llm_arguments(explicit, "cuda", True)
    assert (args["dtype"], args["kv_cache_memory_bytes"], args["enforce_eager"]) == ("float16", 1 << 30, True)
    assert (args["load_format"], args["max_num_seqs"], args["enable_prefix_caching"]) == ("dummy", 7, False)
    with pytest.raises(ValueError, match="enable_chunked_prefill=true is not supported on CPU"):
        llm_arguments(RolloutConfig(model_path="m", enable_chunked_prefill=True), "cpu", False)


@pytest.mark.parametrize(
    "device, trainable, dtype, mixed",
    [
        ("cuda", True, "float32", "bfloat16"),  # fp32 master weights, bf16 compute
        ("cuda", False, "bfloat16", None),  # frozen reference / reward model: bf16 weights
        ("cpu", True, "float32", None),
        ("cpu", False, "float32", None),
    ],
)
def test_auto_precision(device, trainable, dtype, mixed):
    model, engine = resolve_precision(ModelConfig(path="m"), EngineConfig(), device, trainable)
    assert (model.dtype, engine.mixed_precision) == (dtype, mixed)
    model, engine = resolve_precision(
        ModelConfig(path="m", dtype="bfloat16"), EngineConfig(mixed_precision=None), device, trainable
    )
    assert (model.dtype, engine.mixed_precision) == ("bfloat16", None)  # explicit values are kept


def test_attn_implementation_errors():
    from backends.hf_model import attention_kwargs

    assert attention_kwargs(ModelConfig(path="m")) == {}
    assert attention_kwargs(ModelConfig(path="m", attn_implementation="eager")) == {"attn_implementation": "eager"}
    assert attention_kwargs(ModelConfig(path="m", override_config={"attn_implementation": "sdpa"})) == {
        "attn_implementation": "sdpa"
    }
    with pytest.raises(ValueError, match="unknown 'flash'"):
        attention_kwargs(ModelConfig(path="m", attn_implementation="flash"))
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs the flash-attn package"):
            attention_kwargs(ModelConfig(path="m", attn_implementation="flash_attention_2"))


def test_megatron_refuses_attn_implementation():
    from backends.megatron.engine import MegatronEngine

    with pytest.raises(ValueError, match="megatron runs megatron-core's own attention"):
        MegatronEngine(ModelConfig(path="m", attn_implementation="sdpa"), None, EngineConfig())
