"""The limit of benchmarks/e2e_step.py's GRPO step: the same work done by plain tools, measured in the same run.

``measure_limit(work)`` starts ``work.world`` processes (one per rank of the step, one thread each, as the step's
ranks run), gives each its share of the prompts (contiguous, as the step's dispatch splits a batch) and times,
with the ranks starting every repetition together (a barrier):

- ``raw vLLM generate``: ``vllm.LLM`` built directly with the engine settings the rollout uses on CPU (float32,
  eager, 64 MiB KV cache, prefix caching, no chunked prefill), one ``generate`` call over the share's prompts
  with ``n`` samples, ``max_tokens`` = the response length, EOS as the stop token, the sampled token's log-prob
  (as the rollout asks); no per-request seeds (the step seeds every request, for reproducibility);
- ``plain forward+backward+AdamW``: the HF model in a plain loop over the tokens just generated (prompt
  left-padded + response, micro-batches of ``work.micro_batch`` rows), a policy-gradient loss on the response
  log-probs, gradient clipping at 1.0 and one AdamW step: the actor update's work without FSDP, without the
  gradient all-reduce and without the PPO bookkeeping;
- ``plain forward (log-probs)``: the same forward under ``no_grad`` (the old-log-prob pass).

The ranks run at Ray's worker niceness (15 unless ``RAY_worker_niceness`` says otherwise), as the step's ranks do.

A repetition's time is its slowest rank's; each part reports the median over ``work.repeats`` repetitions after
``work.warmup``. The step's remaining phases (reward, advantages, weight sync, the driver's work) have no
counterpart here: the limit is what generation and training alone cost.
"""

from __future__ import annotations

import os
import queue as queue_lib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

GEN, TRAIN, FORWARD = "raw vLLM generate", "plain forward+backward+AdamW", "plain forward (log-probs)"
PARTS = (GEN, TRAIN, FORWARD)
KV_CACHE_BYTES = 64 << 20  # the rollout's CPU default (backends/rollout/base.py)
# Ray starts its workers (the step's ranks) at this niceness; the limit's ranks take the same, so that on a shared
# machine both get the same share of the cores against other load (on an idle machine it changes nothing)
RAY_WORKER_NICENESS = int(os.environ.get("RAY_worker_niceness", "15"))
TIMEOUT_S = 900  # a rank that hangs must not hang the benchmark


@dataclass
class Work:
    model: str  # model + tokenizer directory (benchmarks/e2e_step.py's build_model)
    prompts: list[list[int]]  # prompt token ids, one entry per prompt of the step's batch
    n: int  # samples per prompt
    response_length: int
    prompt_length: int  # prompts are left-padded to this
    micro_batch: int  # rows per forward / backward
    world: int = 2  # ranks (processes), one thread each
    warmup: int = 1
    repeats: int = 3


def prompt_ids(data_file: str, model: str, count: int) -> list[list[int]]:
    """Token ids of the first ``count`` prompts of a verl-format parquet file, rendered as the RL dataset does
    (chat template with the generation prompt, then the tokenizer without special tokens)."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = pq.read_table(data_file, columns=["prompt"]).column("prompt").to_pylist()[:count]
    texts = [tok.apply_chat_template(r, add_generation_prompt=True, tokenize=False) for r in rows]
    return tok(texts, add_special_tokens=False)["input_ids"]


def measure_limit(work: Work) -> dict[str, float]:
    """Seconds per part (``PARTS``): the median over repetitions of the slowest rank's time."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # fresh interpreters: no Ray / torch state from the step, one thread each
    barrier, results = ctx.Barrier(work.world), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, work, barrier, results), daemon=True) for r in range(work.world)]
    for p in procs:
        p.start()
    per_rank = {}
    try:
        for _ in procs:
            rank, times = results.get(timeout=TIMEOUT_S)
            if isinstance(times, str):
                raise RuntimeError(f"limit rank {rank} failed: {times}")
            per_rank[rank] = times
    except queue_lib.Empty:
        raise RuntimeError(f"limit ranks gave no result within {TIMEOUT_S} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {
        part: statistics.median(max(times[part][i] for times in per_rank.values()) for i in range(work.repeats))
        for part in PARTS
    }


def _rank_main(rank: int, work: Work, barrier, results) -> None:
    """One rank: generate its share, then train and score the generated rows; puts (rank, {part: [s, ...]}) or
    (rank, error text)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.nice(max(0, RAY_WORKER_NICENESS - os.nice(0)))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process, as the rollout's
    try:
        import torch

        torch.set_num_threads(1)
        per_rank = len(work.prompts) // work.world
        share = work.prompts[rank * per_rank : (rank + 1) * per_rank]
        times, generated = {}, []

        generate = _generator(work, share)
        times[GEN] = _timed(lambda: generated.append(generate()), barrier, work)
        batch = _batch(share, generated[-1], work)
        train, forward = _trainers(work, batch)
        times[TRAIN] = _timed(train, barrier, work)
        times[FORWARD] = _timed(forward, barrier, work)
        results.put((rank, times))
    except Exception as error:  # noqa: BLE001 - the parent reports it; a silent rank would hang the barrier
        barrier.abort()
        results.put((rank, f"{type(error).__name__}: {error}"))


def _timed(fn: Callable[[], object], barrier, work: Work) -> list[float]:
    """Seconds of each measured call of ``fn`` (after the warm-up calls), every call started on all ranks at once."""
    times = []
    for i in range(work.warmup + work.repeats):
        barrier.wait(timeout=TIMEOUT_S)
        start = time.perf_counter()
        fn()
        if i >= work.warmup:
            times.append(time.perf_counter() - start)
    return times


def _generator(work: Work, share: list[list[int]]) -> Callable[[], list[list[int]]]:
    """A call generating ``n`` responses per prompt of ``share`` with a plain ``vllm.LLM``; returns them."""
    import vllm
    from transformers import AutoConfig
    from vllm.inputs import TokensPrompt

    eos = AutoConfig.from_pretrained(work.model).eos_token_id
    llm = vllm.LLM(
        model=work.model,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=work.prompt_length + work.response_length,
        enforce_eager=True,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        enable_chunked_prefill=False,
        enable_prefix_caching=True,
        generation_config="vllm",
    )
    params = vllm.SamplingParams(
        n=work.n, temperature=1.0, max_tokens=work.response_length, stop_token_ids=[eos], logprobs=0, detokenize=False
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in share]

    def generate() -> list[list[int]]:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(s.token_ids) for out in outputs for s in out.outputs]

    return generate


def _batch(share: list[list[int]], responses: list[list[int]], work: Work) -> dict:
    """The rows the step trains on: each prompt left-padded to ``prompt_length``, its response right-padded to
    ``response_length``; masks, positions and a fixed random advantage per row."""
    import torch

    rows, width = len(responses), work.prompt_length + work.response_length
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for row, response in enumerate(responses):
        prompt = share[row // work.n]
        start = work.prompt_length - len(prompt)
        input_ids[row, start : work.prompt_length] = torch.tensor(prompt)
        input_ids[row, work.prompt_length : work.prompt_length + len(response)] = torch.tensor(response)
        mask[row, start : work.prompt_length + len(response)] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    advantages = torch.randn(rows, 1, generator=torch.Generator().manual_seed(0))
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions, "advantages": advantages}


def _trainers(work: Work, batch: dict) -> tuple[Callable[[], None], Callable[[], None]]:
    """(one plain update over ``batch``, one no-grad log-prob pass over it) with the HF model and AdamW."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(work.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    rows, p = batch["input_ids"].shape[0], work.prompt_length
    chunks = [slice(i, min(i + work.micro_batch, rows)) for i in range(0, rows, work.micro_batch)]

    def log_probs(rows: slice) -> tuple:
        ids = batch["input_ids"][rows]
        logits = model(
            input_ids=ids, attention_mask=batch["attention_mask"][rows], position_ids=batch["position_ids"][rows]
        ).logits[:, p - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, p:, None]).squeeze(-1)
        return logp, batch["attention_mask"][rows, p:].float()

    def train() -> None:
        model.train()
        tokens = batch["attention_mask"][:, p:].sum()
        for rows in chunks:
            logp, mask = log_probs(rows)
            (-(logp * batch["advantages"][rows] * mask).sum() / tokens).backward()  # token-mean over the batch
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def forward() -> None:
        model.eval()
        with torch.no_grad():
            for rows in chunks:
                log_probs(rows)

    return train, forward
