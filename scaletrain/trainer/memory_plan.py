"""The memory plan (layer 4): before Ray starts, the bytes each phase of a run holds on one training device, and
whether the device has them (``trainer.memory_check``).

A training device holds every colocated role's states (actor, reference policy, critic, reward model) and, with
the hybrid engine, the rollout engine; each phase adds its own transients on top:

- generate: the rollout engine's weights and KV cache (the actor's states on the host with
  ``rollout.offload_train_during_rollout``);
- log-probs: the largest no-grad forward (old / reference log-probs, values);
- actor update / critic update: that role's training step (backends/memory.py ``train_peak``); a vLLM engine that
  sleeps (CUDA, ``free_cache_engine``) has moved its weights to the host and dropped its KV cache.

The budget is one GPU's memory on CUDA (``nvidia-smi``; the driver process does not touch CUDA), on CPU the host's
available memory shared by the node's ranks; ``trainer.device_memory_gib`` sets it. The plan is logged; a plan over
budget warns (``memory_check=warn``) or fails before Ray (``error``) with its numbers and the settings that would
make it fit, each evaluated with the same arithmetic. Its accuracy against measured peaks: docs/performance.md
(benchmarks/memory_plan.py).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace

from backends import memory as mem
from backends.config import resolve_precision
from scaletrain.controller.push_lanes import RING
from scaletrain.trainer.config.ppo_config import PPOConfig
from scaletrain.trainer.config.worker_configs import engine_config, model_config
from scaletrain.utils.typed_config import ConfigError
from scaletrain.workers.model_sections import with_offload

logger = logging.getLogger(__name__)
STORE_FLOOR = 1 << 30  # the object store of a cluster a run starts, for its batches (ray_cluster.py)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per phase on one training device (each phase: its lines by cause), the host's share of one rank (offload,
    a sleeping engine's weights), the node's shared memory (Ray's object store, a weight-sync copy in /dev/shm) and
    the device's budget."""

    phases: dict[str, dict[str, int]]
    host: dict[str, int]
    budget: int
    device: str
    shared: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: sum(self.phases[name].values()))

    @property
    def peak(self) -> int:
        return sum(self.phases[self.peak_phase].values())

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget

    def render(self) -> str:
        lines = [f"memory plan, per {self.device} device (budget {mem.gib(self.budget)}):"]
        for name, parts in self.phases.items():
            detail = ", ".join(f"{part} {mem.gib(n)}" for part, n in parts.items() if n)
            mark = "  <- peak" if name == self.peak_phase else ""
            lines.append(f"  {name:<14} {mem.gib(sum(parts.values())):>10}  ({detail}){mark}")
        if self.host:
            detail = ", ".join(f"{part} {mem.gib(n)}" for part, n in self.host.items())
            lines.append(f"  host per rank  {mem.gib(sum(self.host.values())):>10}  ({detail})")
        detail = ", ".join(f"{part} {mem.gib(n)}" for part, n in self.shared.items())
        lines.append(f"  shared (node)  {mem.gib(sum(self.shared.values())):>10}  ({detail})")
        return "\n".join(lines)


def memory_plan(cfg: PPOConfig, budget: int | None = None, shape: mem.ModelShape | None = None) -> MemoryPlan:
    """The plan of a resolved config (scaletrain/trainer/config/plan.py ``resolve_config``); ``budget`` (bytes) and
    ``shape`` (the actor model's): the caller's where it has them, else measured / read here."""
    cuda = cfg.trainer.device == "cuda"
    budget = budget if budget is not None else device_budget(cfg)
    shape = shape or actor_shape(cfg)
    roles = dict(_train_roles(cfg, shape, cuda))
    resident, host = {}, {}
    for name, (role_shape, layout, _) in roles.items():
        device, offloaded = mem.state_bytes(role_shape, layout)
        resident |= {f"{name} {part}": n for part, n in device.items()}
        host |= {f"{name} {part}": n for part, n in offloaded.items()}
    engine, kept = _rollout_engine(cfg, shape, cuda, budget)
    phases = {"generate": _generate_phase(cfg, resident, engine, host)}
    awake = {part: n for part, n in engine.items() if part in kept}  # what the engine holds while the trainer works
    if "rollout weights" in engine and "rollout weights" not in kept:
        host["rollout weights (asleep)"] = engine["rollout weights"]
    forwards = [mem.step_bytes(s, lay, micro, backward=False) for s, lay, micro in roles.values()]
    phases["log-probs"] = resident | awake | max(forwards, key=lambda d: sum(d.values()))
    for name, (role_shape, layout, micro) in roles.items():
        if layout.trains:
            phases[f"{name} update"] = resident | awake | mem.step_peak(role_shape, layout, micro)
    woken = {k: v for k, v in engine.items() if k == "rollout weights"}  # a sync wakes the weights, not the cache
    phases["weight sync"] = resident | awake | woken | {"weight sync buckets": _sync_buckets(cfg, shape)}
    device = "cuda" if cuda else "cpu"
    return MemoryPlan(phases, host, budget, device, _shared(cfg, shape))


def _shared(cfg: PPOConfig, shape: mem.ModelShape) -> dict[str, int]:
    """The node's shared memory: Ray's object store (batches between the driver and the workers) and, where vLLM's
    engine core runs in a process of its own (the agent loops' AsyncLLM), what each sync puts in /dev/shm per
    rollout rank of the node (backends/rollout/vllm_engine.py): two bucket slots (``checkpoint_engine`` shm, the
    default), the whole model (naive), nothing (cuda_ipc: device buffers); and split placement's collective push on
    CPU: the export rank's ring of bucket slots its node's rollout ranks read (controller/push_lanes.py)."""
    shared = {"Ray object store": cfg.ray_kwargs.ray_init.object_store_memory or STORE_FLOOR}
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "vllm" and rollout.use_async_engine:
        model = shape.params * _synced_bytes(cfg)
        per_rank = {"naive": model, "shm": min(model, 2 * rollout.weight_bucket_bytes), "cuda_ipc": 0}
        held = per_rank[rollout.checkpoint_engine.engine_process_transport()] * cfg.trainer.n_gpus_per_node
        if held:
            shared["weight sync in /dev/shm"] = held
    ce = rollout.checkpoint_engine
    if not cfg.actor_rollout_ref.hybrid_engine and ce.pool_transport(cfg.trainer.device) == "nccl":
        if cfg.trainer.device == "cpu" and ce.push_same_node() == "shm":
            model = shape.params * _synced_bytes(cfg)
            shared["weight push slots in /dev/shm"] = min(RING * rollout.weight_bucket_bytes, model)
    return shared


def _synced_bytes(cfg: PPOConfig) -> int:
    """Bytes per synced weight: the rollout's dtype on CUDA (bf16 unless float32), float32 on CPU."""
    rollout = cfg.actor_rollout_ref.rollout
    return 2 if cfg.trainer.device == "cuda" and rollout.dtype != "float32" else 4


def _sync_buckets(cfg: PPOConfig, shape: mem.ModelShape) -> int:
    """What a sync's export holds at once on a training device: three buckets (one loading or sending, one ready,
    one being gathered: workers/colocated_rollout.py, controller/weight_transport.py), never more than the model."""
    return min(3 * cfg.actor_rollout_ref.rollout.weight_bucket_bytes, shape.params * _synced_bytes(cfg))


def sized_object_store(cfg: PPOConfig, connected: bool = False) -> PPOConfig:
    """``cfg`` with the object store of the cluster the run starts sized for it (``ray_kwargs.ray_init.
    object_store_memory`` null, no address to join, this process not ``connected`` to Ray already: such a run joins
    that connection and starts nothing): ``STORE_FLOOR`` for the batches, plus, where every sync pushes
    the weights through the store (split placement, ``checkpoint_engine`` naive, or auto on CUDA; not a LoRA
    adapter-only sync), twice the synced weights: one version read by the rollout while the next is put. A store
    smaller than the weights spills them to disk at every push. A model the plan cannot read keeps the floor."""
    ri, arr = cfg.ray_kwargs.ray_init, cfg.actor_rollout_ref
    if connected or ri.object_store_memory is not None or (ri.address and ri.address != "local"):
        return cfg
    size = STORE_FLOOR
    adapter_only = arr.model.lora_rank > 0 and arr.rollout.lora_sync == "adapter"
    through_store = arr.rollout.checkpoint_engine.pool_transport(cfg.trainer.device) == "naive"
    if not arr.hybrid_engine and through_store and not adapter_only:
        try:
            size += 2 * actor_shape(cfg).params * _synced_bytes(cfg)
        except Exception as exc:  # the memory plan says the same where it runs
            logger.warning("ray_kwargs.ray_init.object_store_memory: %s, no size for the model (%s)", STORE_FLOOR, exc)
    ray_kwargs = replace(cfg.ray_kwargs, ray_init=replace(ri, object_store_memory=size))
    return replace(cfg, ray_kwargs=ray_kwargs)


def _generate_phase(cfg: PPOConfig, resident: dict, engine: dict, host: dict) -> dict[str, int]:
    if cfg.actor_rollout_ref.rollout.offload_train_during_rollout:
        moved = {k: v for k, v in resident.items() if k.startswith("actor ")}
        host |= {f"{k} (generate)": v for k, v in moved.items()}
        resident = {k: v for k, v in resident.items() if k not in moved}
    return resident | engine


def actor_shape(cfg: PPOConfig) -> mem.ModelShape:
    """The actor model's shape (the embedded default's model where the path is null)."""
    arr = cfg.actor_rollout_ref
    config = None
    if not arr.model.path:  # the embedded default's model (trainer/embedded_default.py)
        from scaletrain.data.embedded import tiny_qwen2_config

        config = tiny_qwen2_config()
    return mem.model_shape(model_config(arr.model, arr.model.path), config)


def _train_roles(cfg: PPOConfig, shape: mem.ModelShape, cuda: bool) -> Iterator[tuple[str, tuple]]:
    """(role, (its shape, its layout on one rank, its largest micro-batch)) of every training role on a device."""
    arr = cfg.actor_rollout_ref
    frozen = replace(shape, trainable=0)
    actor = arr.actor
    yield (
        "actor",
        (shape, _layout(cfg, actor, arr.model, (actor.fsdp_config, actor.megatron), cuda, True), _micro(cfg, actor)),
    )
    if actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        lora = arr.model.lora_rank > 0  # the reference policy is the actor's base with the adapters off
        if not lora:
            ref_layout = _layout(cfg, actor, arr.model, (arr.ref.fsdp_config, arr.ref.megatron), cuda, False)
            yield "ref", (frozen, ref_layout, _micro(cfg, actor))
    if cfg.use_critic:
        critic = cfg.critic
        critic_shape = (
            shape if not critic.model.path else mem.model_shape(model_config(critic.model, critic.model.path))
        )
        if critic.model.lora_rank == 0:
            critic_shape = replace(critic_shape, trainable=critic_shape.params)
        critic_shape = replace(critic_shape, vocab=1)  # a value head, no vocabulary
        layout = _layout(cfg, critic, critic.model, (critic.model.fsdp_config, critic.megatron), cuda, True)
        yield "critic", (critic_shape, layout, _micro(cfg, critic))
    rm = cfg.reward_model
    if rm.enable and not rm.enable_resource_pool and rm.model.path:
        rm_shape = replace(mem.model_shape(model_config(rm.model, rm.model.path)), trainable=0)
        yield (
            "reward model",
            (rm_shape, _layout(cfg, actor, rm.model, (rm.model.fsdp_config, None), cuda, False), _micro(cfg, actor)),
        )


def _layout(cfg: PPOConfig, section, model, offload: tuple, cuda: bool, trains: bool) -> mem.TrainLayout:
    """A role's layout on one rank (``section``'s megatron layout; ``offload``: the role's fsdp_config and megatron
    sections, workers/model_sections.py with_offload), its precision and offload resolved as its engine resolves
    them."""
    backend, meg = cfg.backend, section.megatron
    engine = with_offload(engine_config(backend, cfg.trainer.seed), backend.name, *offload)
    model, engine = resolve_precision(model_config(model, model.path), engine, "cuda" if cuda else "cpu", trains)
    half = model.dtype in ("bfloat16", "float16")
    zero = backend.extra.get("deepspeed_config", {}).get("zero_optimization", {})
    # megatron: the layout its engine resolves (the role's keys over backend.extra.megatron's, their defaults)
    split = meg.resolved(backend.extra) if backend.name == "megatron" else None
    return mem.TrainLayout(
        backend=backend.name,
        world=cfg.world_size,
        tp=split.tensor_model_parallel_size if split else 1,
        pp=split.pipeline_model_parallel_size if split else 1,
        ep=split.expert_model_parallel_size if split else 1,
        etp=split.etp if split else None,
        sp=getattr(section, "ulysses_sequence_parallel_size", 1) or 1,
        distributed_optimizer=bool(split and split.use_distributed_optimizer),
        weight_bytes=2 if half else 4,
        compute_bytes=2 if engine.mixed_precision or half else 4,
        trains=trains,
        param_offload=engine.param_offload,
        optimizer_offload=engine.optimizer_offload,
        grad_offload=engine.grad_offload,
        reduce_bucket=int(zero.get("reduce_bucket_size", mem.DEEPSPEED_REDUCE_BUCKET)),
        head_chunk_rows=engine.entropy_chunk_size,
    )


def _micro(cfg: PPOConfig, section) -> mem.MicroBatchShape:
    rollout = cfg.actor_rollout_ref.rollout
    prompt, response = rollout.prompt_length or 0, rollout.response_length or 0
    length = prompt + response
    megatron = cfg.backend.name == "megatron"
    if section.use_dynamic_bsz and not megatron:
        tokens = max(section.ppo_max_token_len_per_gpu, length)
        head = tokens * response // max(1, length)
    else:
        rows = section.ppo_micro_batch_size_per_gpu
        tokens, head = rows * length, rows * response
    section_model = getattr(section, "model", None) or cfg.actor_rollout_ref.model
    model = model_config(section_model, section_model.path)
    attn = model.attn_implementation or model.override_config.get("attn_implementation") or "sdpa"
    return mem.MicroBatchShape(
        tokens=tokens,
        head_positions=head,
        packed=model.use_remove_padding and not megatron,
        dense_mask=attn != "flash_attention_2",
        recompute=model.enable_gradient_checkpointing,
    )


def _rollout_engine(cfg: PPOConfig, shape: mem.ModelShape, cuda: bool, budget: int) -> tuple[dict, set]:
    """(the hybrid engine's bytes on a training device while it generates, the lines it keeps while the trainer
    works: the HF engine its weights; vLLM everything, or nothing where it sleeps)."""
    arr = cfg.actor_rollout_ref
    rollout = arr.rollout
    if not arr.hybrid_engine:
        return {}, set()  # on its own pool
    weight_bytes = 4 if rollout.dtype == "float32" or (rollout.dtype == "auto" and not cuda) else 2
    rows = cfg.data.train_batch_size * rollout.n // max(1, cfg.world_size)
    length = (rollout.prompt_length or 0) + (rollout.response_length or 0)
    if rollout.name == "hf":
        return mem.hf_rollout_bytes(shape, weight_bytes, rows, length, rollout.response_length or 0), {
            "rollout weights"
        }
    kv = rollout.kv_cache_bytes
    if kv is None:
        weights = shape.params * weight_bytes // rollout.tensor_model_parallel_size
        kv = int(rollout.gpu_memory_utilization * budget) - weights if cuda else mem.CPU_KV_CACHE_BYTES
    engine = mem.vllm_bytes(shape, rollout.tensor_model_parallel_size, weight_bytes, max(0, kv))
    sleeps = cuda and rollout.enable_sleep_mode and rollout.free_cache_engine
    return engine, set() if sleeps else set(engine)


def device_budget(cfg: PPOConfig) -> int:
    """One training device's bytes: ``trainer.device_memory_gib``, else the first GPU's memory (nvidia-smi) on CUDA,
    else the host's available memory over the node's ranks."""
    if cfg.trainer.device_memory_gib is not None:
        return int(cfg.trainer.device_memory_gib * mem.GIB)
    if cfg.trainer.device == "cuda" and shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=False).stdout.split()
        if out:
            return int(out[0]) * mem.MIB
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return available // max(1, cfg.trainer.n_gpus_per_node)


def _remedies(cfg: PPOConfig) -> Iterator[tuple[str, PPOConfig]]:
    """The settings that shrink a plan and apply to this config, one at a time: (the override, the config with it)."""
    arr = cfg.actor_rollout_ref
    actor, model, rollout = arr.actor, arr.model, arr.rollout
    if not model.enable_gradient_checkpointing:
        yield (
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            _with(cfg, model=replace(model, enable_gradient_checkpointing=True)),
        )
    if actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu > 1024:
        half = actor.ppo_max_token_len_per_gpu // 2
        yield (
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={half}",
            _with(cfg, actor=replace(actor, ppo_max_token_len_per_gpu=half)),
        )
    elif not actor.use_dynamic_bsz and actor.ppo_micro_batch_size_per_gpu > 1:
        half = actor.ppo_micro_batch_size_per_gpu // 2
        yield (
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={half}",
            _with(cfg, actor=replace(actor, ppo_micro_batch_size_per_gpu=half)),
        )
    if not cfg.backend.optimizer_offload:
        yield "backend.optimizer_offload=true", replace(cfg, backend=replace(cfg.backend, optimizer_offload=True))
    if not cfg.backend.param_offload:
        yield "backend.param_offload=true", replace(cfg, backend=replace(cfg.backend, param_offload=True))
    if cfg.trainer.device == "cuda" and rollout.name == "vllm" and rollout.gpu_memory_utilization > 0.3:
        yield (
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
            _with(cfg, rollout=replace(rollout, gpu_memory_utilization=0.3)),
        )


def _with(cfg: PPOConfig, **sections) -> PPOConfig:
    return replace(cfg, actor_rollout_ref=replace(cfg.actor_rollout_ref, **sections))


def check_memory(cfg: PPOConfig) -> MemoryPlan | None:
    """Log the plan of a resolved config; over budget: a warning or (``trainer.memory_check=error``) a
    ``ConfigError`` with the plan and the single settings that would make it fit. None with the check off."""
    mode = cfg.trainer.memory_check
    if mode == "off":
        return None
    try:
        shape = actor_shape(cfg)  # once: no remedy below changes the model
        plan = memory_plan(cfg, shape=shape)
    except Exception as exc:  # a model or layout the arithmetic does not know: the check, not the run, gives way
        if mode == "error":
            raise ConfigError(f"trainer.memory_check=error: the memory plan could not be computed: {exc}") from exc
        logger.warning("trainer.memory_check: no memory plan for this config (%s: %s)", type(exc).__name__, exc)
        return None
    if plan.fits:
        logger.info("%s", plan.render())
        return plan
    fixes = []
    for key, changed in _remedies(cfg):
        other = memory_plan(changed, plan.budget, shape)
        if other.fits:
            fixes.append(f"{key} ({mem.gib(other.peak)})")
    advice = (
        "; each of these alone would fit: " + ", ".join(fixes)
        if fixes
        else "; no single setting makes it fit: more ranks (trainer.n_gpus_per_node, trainer.nnodes), several "
        "remedies together (gradient checkpointing, smaller micro-batches, offload), or a smaller model"
    )
    message = (
        f"trainer.memory_check: the {plan.peak_phase} phase needs {mem.gib(plan.peak)} per device, over the "
        f"{mem.gib(plan.budget)} budget (trainer.device_memory_gib){advice}\n{plan.render()}"
    )
    if mode == "error":
        raise ConfigError(message + "\n(trainer.memory_check=warn: start anyway)")
    logger.warning("%s", message)
    return plan
