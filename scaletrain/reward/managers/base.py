"""RewardManager: the logic every reward manager shares, and the registry that names them.

A manager turns a rollout batch into token-level scores:

1. read the rows (``read_rows``): decode the valid prompt and response tokens, check the schema
   (``data_source``, ``reward_model.ground_truth``; a bad row raises ValueError naming the row and key),
2. score them in worker processes (``score_rows``; per sample by default, the ``batch`` manager overrides it),
   with a timeout per call and (``step_timeout_s``) one for the whole call: a scorer that raises or overruns gives
   0 for that sample and is counted in ``reward/errors`` / ``reward/timeouts`` (``reward/failed_fraction``: their
   share); the first few failures are logged, the last one is kept (``last_error``),
3. let the subclass adjust the scores (``adjust_scores``; e.g. DAPO's overlong penalty),
4. place each row's score on its last valid response token of a (B, R) float tensor.

Batch layout: tensors ``prompts`` (B, P) left-padded, ``responses`` (B, R) right-padded, ``attention_mask``
(B, P+R); non-tensors ``data_source`` (str), ``reward_model`` (dict with ``ground_truth``), optionally
``extra_info`` (dict or None). A row's valid response tokens are those where the response part of
``attention_mask`` is 1; its score goes on the last of them (a row with none gets no score). ``response_mask``
is not used: in multi-turn rollouts it also zeroes tool-output tokens, which are still part of the response.

What a scorer receives, by keyword as verl passes them: ``data_source`` (the ``reward_fn_key`` column),
``solution_str`` (the response decoded with ``skip_special_tokens=True``) and ``ground_truth``, and
``extra_info``: a copy of the row's extra_info (a dict, empty if the row had None) plus verl's ``num_turns``
(the ``__num_turns__`` column, else None) and ``rollout_reward_scores`` (the ``reward_scores`` column, else {}),
and ``extra_info["response_ended_with_eos"]``: whether the last valid response token is an EOS id
(``eos_token_id`` argument, default the tokenizer's). A response cut off at the length limit has False; the
arithmetic scorer uses it to give credit only to finished answers.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from scaletrain.protocol import DataProto
from scaletrain.reward.in_process import scoring_runner
from scaletrain.reward.judge import Judge, bind_judge
from scaletrain.reward.managers.abstract import AbstractRewardManager
from scaletrain.reward.sandbox import ERROR, OK, TIMEOUT, Outcome
from scaletrain.reward.sandbox_fusion import SandboxFusion, bind_sandbox
from scaletrain.reward.scorers.arithmetic import ENDED_WITH_EOS_KEY
from scaletrain.reward.scorers.default import default_compute_score
from scaletrain.utils.registry import Registry

logger = logging.getLogger(__name__)

REWARD_MANAGERS = Registry("reward manager")
DEFAULT_TIMEOUT_S = 30.0
LOG_FIRST_N_FAILURES = 5


def register_reward_manager(name: str) -> Callable[[type], type]:
    """Class decorator: make a RewardManager subclass available as ``reward_model.reward_manager=<name>``."""
    return REWARD_MANAGERS.register(name)


def get_reward_manager(name: str) -> type:
    """The manager class registered as ``name``; ValueError listing the registered names if none."""
    return REWARD_MANAGERS.get(name)


@dataclass
class Rows:
    """The decoded, checked rows of one batch, in batch order."""

    data_sources: list[str]
    ground_truths: list[Any]
    extra_infos: list[dict]
    prompt_strs: list[str]
    response_strs: list[str]
    response_lengths: torch.Tensor  # (B,) index of the last valid response token + 1; 0 if none
    ended_with_eos: list[bool]

    def __len__(self) -> int:
        return len(self.response_strs)

    def scorer_kwargs(self, i: int) -> dict[str, Any]:
        """Row ``i`` as the keywords a scorer is called with (verl calls scorers by keyword too)."""
        return {
            "data_source": self.data_sources[i],
            "solution_str": self.response_strs[i],
            "ground_truth": self.ground_truths[i],
            "extra_info": self.extra_infos[i],
        }


def to_score(value: Any) -> tuple[float, dict[str, Any]]:
    """A scorer's return value as (score, extra metrics). Raises TypeError/ValueError for anything else than a
    finite number or a dict with a finite number under "score"."""
    extra: dict[str, Any] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"scorer returned a dict without 'score' (keys {sorted(value)})")
        extra = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"scorer returned {type(value).__name__} {value!r}; expected a number or a dict with 'score'")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"scorer returned a non-finite score {score}")
    return score, extra


def _row_value(non_tensor: Mapping[str, Any], key: str, i: int, default: Any) -> Any:
    column = non_tensor.get(key)
    return default if column is None else column[i]


class RewardManager(AbstractRewardManager):
    """Base of scaletrain's reward managers; a manager is called with a batch and returns token-level scores.

    Args (verl's first five, in verl's order):
        tokenizer: decodes prompts and responses (``batch_decode`` if it has one, else ``decode`` per row).
        num_examine: log this many decoded samples per data_source on every call (INFO).
        compute_score: the scorer (default ``default_compute_score``), called with the keywords
            ``data_source, solution_str, ground_truth, extra_info``; a function that cannot be pickled scores
            in this process (in_process.py), any other in worker processes (sandbox.py).
        reward_fn_key: the non-tensor column naming each row's data source.
        compute_score_timeout: seconds one scorer call may take (None or 0: no limit; verl's default is None,
            scaletrain's 30 s, so that a hung scorer cannot stop a run).
        num_processes: worker processes scoring in parallel.
        eos_token_id: int or list of ints counted as EOS (default: the tokenizer's eos_token_id).
        mp_context: worker start method ("forkserver" default, "spawn").
        start_timeout_s: seconds a worker may take to start.
        step_timeout_s: seconds one call of the manager may spend scoring (None: no bound); samples not scored
            by then get 0 and count as timeouts.
        judge: a generative judge (reward/judge.py) bound to the async ``compute_score`` as ``judge`` (and/or
            verl's ``reward_router_address``); its counters join the metrics (``judge/*``).
        sandbox: a code sandbox service (reward/sandbox_fusion.py): the default scorer runs verl's code data
            sources through it, a user's function gets it bound (``bind_sandbox``); counters ``sandbox_fusion/*``.
    """

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int = 0,
        compute_score: Callable[..., Any] | None = None,
        reward_fn_key: str = "data_source",
        compute_score_timeout: float | None = DEFAULT_TIMEOUT_S,
        *,
        num_processes: int = 1,
        eos_token_id: int | list[int] | None = None,
        mp_context: str | None = None,
        start_timeout_s: float = 120.0,
        step_timeout_s: float | None = None,
        judge: Judge | None = None,
        sandbox: SandboxFusion | None = None,
    ):
        self.tokenizer = tokenizer
        self.compute_score = compute_score if compute_score is not None else self.default_scorer()
        self.judge, self.sandbox = judge, sandbox
        self.compute_score = self.bind_services(self.compute_score, compute_score is None)
        self.num_examine = num_examine
        self.reward_fn_key = reward_fn_key
        eos = getattr(tokenizer, "eos_token_id", None) if eos_token_id is None else eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, (list, tuple, set)) else [eos]) - {None}
        if not self.eos_token_ids:
            logger.warning("reward manager: no EOS token id known; every response counts as not ended with EOS")
        self.pool = scoring_runner(
            self.compute_score, num_processes, compute_score_timeout, mp_context, start_timeout_s, self._close_services
        )
        self.step_timeout_s = step_timeout_s
        self.last_error: str | None = None  # the most recent failure's traceback (or timeout reason)
        self.failures_logged = 0  # full failure logs so far (the first LOG_FIRST_N_FAILURES), then counts only
        self.last_logged_error: str | None = None

    @property
    def scorer_repr(self) -> str:
        """The scorer as errors name it (secrets bound to it redacted)."""
        return self.pool.fn_repr

    def default_scorer(self) -> Callable[..., Any]:
        return default_compute_score

    def bind_services(self, fn: Callable[..., Any], is_default: bool) -> Callable[..., Any]:
        """The scorer with the remote services bound (``is_default``: the manager's default scorer). An async
        function awaiting one is scored concurrently (AsyncScorer)."""
        if self.sandbox is not None:
            fn = bind_sandbox(fn, self.sandbox, is_default)
        if self.judge is not None:
            fn = bind_judge(fn, self.judge)
        return fn

    async def _close_services(self) -> None:
        """Run on the scoring loop when it stops: the services' connections belong to it."""
        for service in (self.judge, self.sandbox):
            if service is not None:
                await service.aclose()

    # ---------------------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Stop the worker processes."""
        self.pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------- call
    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        start = time.perf_counter()
        rows = self.read_rows(data)
        outcomes = self.score_rows(rows) if len(rows) else []
        scores, extra_info, counts = self.collect(rows, outcomes)
        final = self.adjust_scores(rows, list(scores), extra_info)
        reward_tensor = self.place(data.tensors["responses"], rows.response_lengths, final)
        self.examine(rows, final)

        if not return_dict:
            return reward_tensor
        metrics = {
            "reward/errors": counts[ERROR],
            "reward/timeouts": counts[TIMEOUT],
            "reward/failed_fraction": (counts[ERROR] + counts[TIMEOUT]) / len(rows) if len(rows) else 0.0,
            "reward/worker_restarts": self.pool.restarts,
            "reward/score_mean": sum(final) / len(final) if final else 0.0,
            "reward/seconds": time.perf_counter() - start,
        }
        metrics.update(self.extra_metrics(rows, extra_info))
        for service in (self.judge, self.sandbox):
            if service is not None:
                metrics.update(service.metrics())
        return {"reward_tensor": reward_tensor, "reward_extra_info": extra_info, "metrics": metrics}

    # -------------------------------------------------------------------------------------- steps (hooks)
    def score_rows(self, rows: Rows) -> list[Outcome]:
        """One scorer call per row in the pool; one Outcome per row."""
        calls = [((), rows.scorer_kwargs(i)) for i in range(len(rows))]
        return self.pool.map(calls, self.step_timeout_s)

    def adjust_scores(self, rows: Rows, scores: list[float], extra_info: dict[str, list]) -> list[float]:
        """Final per-row scores from the scorers' ones; may add per-row lists to ``extra_info``."""
        return scores

    def extra_metrics(self, rows: Rows, extra_info: dict[str, list]) -> dict[str, float]:
        return {}

    # ------------------------------------------------------------------------------------------ shared steps
    def read_rows(self, data: DataProto) -> Rows:
        batch, non_tensor = data.batch, data.non_tensor_batch
        for key in ("prompts", "responses", "attention_mask"):
            if batch is None or key not in batch.keys():
                raise ValueError(f"reward manager needs tensor '{key}' in the batch; have {data.keys()}")
        for key in (self.reward_fn_key, "reward_model"):
            if key not in non_tensor:
                raise ValueError(f"reward manager needs non-tensor '{key}' in the batch; have {data.keys()}")
        prompts, responses, mask = batch["prompts"], batch["responses"], batch["attention_mask"]
        prompt_len, response_len = prompts.shape[1], responses.shape[1]
        if mask.shape[1] != prompt_len + response_len:
            raise ValueError(
                f"attention_mask has {mask.shape[1]} columns; expected prompts ({prompt_len}) + responses "
                f"({response_len})"
            )
        prompt_mask, response_mask = mask[:, :prompt_len].bool(), mask[:, prompt_len:].bool()

        # last valid response position + 1 (0 for a row without any), and the token there
        positions = torch.arange(1, response_len + 1, device=response_mask.device)
        response_lengths = torch.zeros(len(data), dtype=torch.long, device=response_mask.device)
        if response_len:
            response_lengths = (positions * response_mask).max(dim=1).values
        last_tokens = [row[n - 1].item() if n else None for row, n in zip(responses, response_lengths.tolist())]
        ended_with_eos = [tok is not None and tok in self.eos_token_ids for tok in last_tokens]

        prompt_ids = [row[m].tolist() for row, m in zip(prompts, prompt_mask)]
        response_ids = [row[m].tolist() for row, m in zip(responses, response_mask)]
        prompt_strs = self.decode(prompt_ids, skip_special_tokens=False)
        response_strs = self.decode(response_ids, skip_special_tokens=True)

        extra_column = non_tensor.get("extra_info")
        data_sources, ground_truths, extra_infos = [], [], []
        for i in range(len(data)):
            reward_model = non_tensor["reward_model"][i]
            if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
                found = sorted(reward_model) if isinstance(reward_model, Mapping) else type(reward_model).__name__
                raise ValueError(f"row {i}: reward_model has no 'ground_truth' key (got {found})")
            extra = extra_column[i] if extra_column is not None else None
            if extra is not None and not isinstance(extra, Mapping):
                raise ValueError(f"row {i}: extra_info must be a dict or None, got {type(extra).__name__}")
            extra = dict(extra or {})
            extra[ENDED_WITH_EOS_KEY] = ended_with_eos[i]
            extra.setdefault("num_turns", _row_value(non_tensor, "__num_turns__", i, None))  # verl's two keys
            extra.setdefault("rollout_reward_scores", _row_value(non_tensor, "reward_scores", i, {}))
            data_sources.append(non_tensor[self.reward_fn_key][i])
            ground_truths.append(reward_model["ground_truth"])
            extra_infos.append(extra)
        return Rows(
            data_sources, ground_truths, extra_infos, prompt_strs, response_strs, response_lengths, ended_with_eos
        )

    def decode(self, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
        """The token id lists as strings: one ``batch_decode`` call, or ``decode`` per row for a tokenizer
        without it (a verl test's stand-in)."""
        batch_decode = getattr(self.tokenizer, "batch_decode", None)
        if batch_decode is not None:
            return batch_decode(ids, skip_special_tokens=skip_special_tokens)
        return [self.tokenizer.decode(row, skip_special_tokens=skip_special_tokens) for row in ids]

    def collect(self, rows: Rows, outcomes: list[Outcome]) -> tuple[list[float], dict[str, list], dict[str, int]]:
        """Scores (0 for failed rows), per-row extra info ("score" plus the keys of dict scores; None where a
        row lacks a key) and failure counts."""
        scores: list[float] = []
        extras: list[dict[str, Any]] = []
        counts = {OK: 0, ERROR: 0, TIMEOUT: 0}
        for i, outcome in enumerate(outcomes):
            status, error = outcome.status, outcome.error
            score, extra = 0.0, {}
            if status == OK:
                try:
                    score, extra = to_score(outcome.value)
                except (TypeError, ValueError) as e:
                    status, error = ERROR, str(e)
            counts[status] += 1
            if status != OK:
                self.last_error = error
                self.log_failure(i, rows, status, error)
            scores.append(score)
            extras.append(extra)
        failed = counts[ERROR] + counts[TIMEOUT]
        if failed:
            logger.warning(
                "reward: %d of %d samples scored 0 because the scorer failed (%d errors, %d timeouts)",
                failed,
                len(outcomes),
                counts[ERROR],
                counts[TIMEOUT],
            )
        keys = sorted({k for extra in extras for k in extra})
        extra_info: dict[str, list] = {"score": list(scores)}
        for key in keys:
            extra_info[key] = [extra.get(key) for extra in extras]
        return scores, extra_info, counts

    def log_failure(self, index: int, rows: Rows, status: str, error: str | None) -> None:
        if self.failures_logged >= LOG_FIRST_N_FAILURES or error == self.last_logged_error:
            return
        self.failures_logged += 1
        self.last_logged_error = error
        logger.warning(
            "reward scorer %s on row %d (data_source=%r, response=%r)%s:\n%s",
            status,
            index,
            rows.data_sources[index],
            rows.response_strs[index][:200],
            " [further failures are only counted]" if self.failures_logged == LOG_FIRST_N_FAILURES else "",
            error,
        )

    @staticmethod
    def place(responses: torch.Tensor, response_lengths: torch.Tensor, scores: list[float]) -> torch.Tensor:
        """A (B, R) float32 tensor, zero except ``scores[i]`` at row i's last valid response token."""
        reward_tensor = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
        rows = torch.nonzero(response_lengths > 0, as_tuple=True)[0]
        values = torch.tensor(scores, dtype=torch.float32, device=responses.device)
        reward_tensor[rows, response_lengths[rows] - 1] = values[rows]
        return reward_tensor

    def examine(self, rows: Rows, scores: list[float]) -> None:
        if self.num_examine <= 0:
            return
        shown: dict[str, int] = {}
        for i, source in enumerate(rows.data_sources):
            if shown.get(source, 0) >= self.num_examine:
                continue
            shown[source] = shown.get(source, 0) + 1
            logger.info(
                "[reward sample] data_source=%s\n[prompt] %s\n[response] %s\n[ground_truth] %s\n[score] %s",
                source,
                rows.prompt_strs[i],
                rows.response_strs[i],
                rows.ground_truths[i],
                scores[i],
            )
