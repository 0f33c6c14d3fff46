"""AgentLoopManager: runs one agent loop per trajectory, all concurrently, and assembles a training batch.

``generate_sequences(prompts, sampling, n)`` takes the dataset rows (non-tensor ``raw_prompt``, ``extra_info``,
optional ``agent_name`` and ``raw_prompt_ids``; tensors are ignored), repeats each row ``n`` times (samples of a
prompt adjacent), runs the registered loop named by the row's ``agent_name`` (default
``multi_turn.default_agent_loop``) for every trajectory on one event loop, and returns a DataProto in the rollout
layout (backends/rollout/base.py): ``prompts`` (left-padded to ``prompt_length``; a longer rendered prompt fails
naming the row), ``responses`` / ``response_mask`` / ``rollout_log_probs`` (``response_length`` columns; the mask
is 1 on model tokens only), ``input_ids`` / ``attention_mask`` (1 on every real token, tool and user tokens
included) / ``position_ids``, and the non-tensor fields ``num_turns``, ``turn_scores``, ``tool_rewards`` (and
``rollout_version``, the oldest weight version in each trajectory, where the engines report it; and, with a
vision-language model's ``processor``, ``multi_modal_inputs``: every image of the trajectory, prompt's and
tools', in order).
``meta_info["metrics"]`` holds ``num_turns/*`` and ``agent/*`` (tool calls, tool errors and timeouts, malformed
calls, generate batches).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from backends.vision import MULTI_MODAL_INPUTS
from scaletrain.agent.base import AgentLoopOutput, get_agent_loop
from scaletrain.agent.server import AsyncServerManager
from scaletrain.protocol import DataProto, object_column
from scaletrain.utils.seeding import derive_seed

logger = logging.getLogger(__name__)
ROW_FIELDS = (
    "raw_prompt",
    "raw_prompt_ids",
    "extra_info",
    "data_source",
    "reward_model",
    "index",
    "multi_modal_data",  # a vision-language model's rows: the prompt's images
    "multi_modal_inputs",  # and their processor inputs
)


class AgentLoopManager:
    def __init__(
        self,
        config,
        server_manager: AsyncServerManager,
        tokenizer,
        *,
        prompt_length: int,
        response_length: int,
        pad_token_id: int | None = None,
        processor: Any = None,
    ) -> None:
        from scaletrain.agent.interactions.base import load_interactions
        from scaletrain.agent.tools.base import load_tools

        self.config = config
        self.server_manager = server_manager
        self.tokenizer, self.processor = tokenizer, processor
        self.prompt_length, self.response_length = int(prompt_length), int(response_length)
        pad = pad_token_id if pad_token_id is not None else tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.eos_token_id)
        self.default_loop = config.default_agent_loop or ("tool_agent" if config.enable else "single_turn_agent")
        self.tools = {t.name: t for t in load_tools(config.tools_config_file)} if config.tools_config_file else {}
        self.interactions = load_interactions(config.interaction_config_file) if config.interaction_config_file else {}
        self._loops: dict[str, Any] = {}

    def _loop(self, name: str):
        if name not in self._loops:
            cls = get_agent_loop(name)
            self._loops[name] = cls(
                self.config,
                self.server_manager,
                self.tokenizer,
                response_length=self.response_length,
                prompt_length=self.prompt_length,
                tools=self.tools,
                interactions=self.interactions,
                processor=self.processor,
            )
        return self._loops[name]

    # --------------------------------------------------------------------------------------------- run
    def generate_sequences(
        self,
        prompts: DataProto,
        sampling: dict[str, Any],
        n: int = 1,
        tag: str = "traj",
        on_trajectory: Callable[[int, DataProto], None] | None = None,
    ) -> DataProto:
        """``sampling``: temperature / top_p / top_k / seed (seed: per-trajectory seeds derive from it);
        ``on_trajectory(sample, row)``: called as each trajectory finishes with its index in the output and its
        row of it (the streaming reward loop scores it then: scaletrain/trainer/rollout/reward_loop.py)."""
        rows = self._rows(prompts, n, tag)
        self.server_manager.reset_stats()
        start = time.perf_counter()
        outputs = asyncio.run(self._run_all(rows, sampling, on_trajectory))
        out = self._assemble(outputs)
        versions = self.server_manager.pop_versions([row["request_id"] for row in rows])
        if all(v is not None for v in versions):  # split placement: the oldest weights in each trajectory
            out.non_tensor_batch["rollout_version"] = np.array(versions, dtype=np.int64)
        out.meta_info["metrics"] = self._metrics(outputs, time.perf_counter() - start)
        return out

    def _rows(self, prompts: DataProto, n: int, tag: str) -> list[dict[str, Any]]:
        nt = prompts.non_tensor_batch
        if "raw_prompt" not in nt:
            raise ValueError("agent loops need the non-tensor field 'raw_prompt' (chat messages) in the batch")
        names = nt.get("agent_name")
        rows = []
        for i in range(len(prompts)):
            name = names[i] if names is not None and names[i] else self.default_loop
            row = {k: nt[k][i] for k in ROW_FIELDS if k in nt}
            for j in range(n):
                rows.append({**row, "agent_name": str(name), "request_id": f"{tag}-{i}-{j}", "sample": i * n + j})
        return rows

    async def _run_all(
        self, rows: list[dict[str, Any]], sampling: dict[str, Any], on_trajectory: Callable | None = None
    ) -> list[AgentLoopOutput]:
        try:
            for row in rows:  # every trajectory is live from the start: the batcher waits for all of them
                self.server_manager.acquire(row["request_id"])
            return await asyncio.gather(*(self._run_one(row, sampling, on_trajectory) for row in rows))
        finally:
            for row in rows:
                self.server_manager.release(row["request_id"])
            await self.server_manager.close()

    async def _run_one(
        self, row: dict[str, Any], sampling: dict[str, Any], on_trajectory: Callable | None = None
    ) -> AgentLoopOutput:
        params = dict(sampling)
        if params.get("seed") is not None:
            params["seed"] = derive_seed(int(params["seed"]), row["sample"])
        try:
            output = await self._loop(row["agent_name"]).run(params, **row)
        finally:
            self.server_manager.release(row["request_id"])
        if on_trajectory is not None:
            on_trajectory(row["sample"], self._assemble([output]))
        return output

    # ---------------------------------------------------------------------------------------- assemble
    def _assemble(self, outputs: list[AgentLoopOutput]) -> DataProto:
        B, R = len(outputs), self.response_length
        P = max([self.prompt_length] + [len(o.prompt_ids) for o in outputs])
        prompts = torch.full((B, P), self.pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((B, P), dtype=torch.long)
        responses = torch.full((B, R), self.pad_id, dtype=torch.long)
        response_attn = torch.zeros((B, R), dtype=torch.long)
        response_mask = torch.zeros((B, R), dtype=torch.long)
        log_probs = torch.zeros((B, R), dtype=torch.float32)
        for i, o in enumerate(outputs):
            p, r = len(o.prompt_ids), min(len(o.response_ids), R)
            if p:
                prompts[i, P - p :] = torch.tensor(o.prompt_ids, dtype=torch.long)
                prompt_mask[i, P - p :] = 1
            if r:
                responses[i, :r] = torch.tensor(o.response_ids[:r], dtype=torch.long)
                response_attn[i, :r] = 1
                response_mask[i, :r] = torch.tensor(o.response_mask[:r], dtype=torch.long)
                log_probs[i, :r] = torch.tensor(o.response_logprobs[:r], dtype=torch.float32)
        attention_mask = torch.cat([prompt_mask, response_attn], dim=1)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        tensors = {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "rollout_log_probs": log_probs * response_mask,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
        non_tensors = {
            "num_turns": np.array([o.num_turns for o in outputs], dtype=np.int64),
            "turn_scores": object_column([list(o.extra_fields.get("turn_scores", [])) for o in outputs]),
            "tool_rewards": object_column([list(o.extra_fields.get("tool_rewards", [])) for o in outputs]),
        }
        if any(o.multi_modal_inputs for o in outputs):  # each row's images, for the trainer's forward
            non_tensors[MULTI_MODAL_INPUTS] = object_column([o.multi_modal_inputs or {} for o in outputs])
        return DataProto.from_dict(tensors, non_tensors)

    def _metrics(self, outputs: list[AgentLoopOutput], wall_s: float) -> dict[str, float]:
        turns = np.array([o.num_turns for o in outputs], dtype=np.float64)
        metrics = {
            "num_turns/mean": float(turns.mean()),
            "num_turns/max": float(turns.max()),
            "num_turns/min": float(turns.min()),
        }
        totals: dict[str, float] = {}
        for o in outputs:
            for k, v in o.metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        for key in (
            "tool_calls",
            "tool_errors",
            "tool_timeouts",
            "parse_errors",
            "tool_calls_dropped",
            "truncated_by_length",
        ):
            totals.setdefault(key, 0.0)
        for k, v in totals.items():
            metrics[f"agent/{k}"] = v
            if k in ("tool_calls", "assistant_turns", "user_turns"):
                metrics[f"agent/{k}_per_traj"] = v / len(outputs)
        stats = self.server_manager.stats
        metrics["agent/generate_requests"] = float(stats["requests"])
        if self.server_manager.batched:  # the driver-side batcher's batches (the async engines batch on their own)
            metrics["agent/generate_batches"] = float(stats["batches"])
            metrics["agent/mean_batch_size"] = stats["requests"] / max(1, stats["batches"])
        metrics["agent/wall_s"] = wall_s
        if self.server_manager.segment_tokens:
            metrics["async/partial_rollouts"] = float(stats["partial_rollouts"])
        return metrics
