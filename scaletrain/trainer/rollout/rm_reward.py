"""The reward model in the PPO loop (layer 4): its worker's config from ``reward_model.*``, the checks of those keys
before Ray starts, and how its score becomes the reward.

With ``reward_model.enable=true`` the trainer colocates a RewardModelWorker with the other roles and calls
``compute_rm_score`` on every step's rollouts (validation scores with the rule reward only, as verl's does). The
RM's score (``rm_scores``, one value per row at its last valid response token) then

- replaces the rule reward when no ``custom_reward_function.path`` is set: verl's reward managers return
  ``rm_scores`` as the reward as soon as the batch holds them, without calling the rule scorer;
- is added to the rule reward when ``custom_reward_function.path`` is set. verl's legacy managers would drop the
  user's function silently here (its newer reward loop calls only that function); adding both keeps each
  configured reward in effect, and a function returning 0 gives the RM's score alone.

Each component is multiplied by its weight first (``reward.rule_weight``, ``reward.reward_model_weight``).

Metrics: ``reward_model/score/{mean,max,min}`` (per row); each row's RM score also goes into the reward extra info
as ``rm_score`` (so rollout dumps show it next to the final ``score``), and, when added to the rule reward, the
rule's as ``rule_score`` (the reward-health signal ``judge_rule_disagreement`` compares them:
scaletrain/trainer/step/reward_health.py).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from scaletrain.protocol import DataProto
from scaletrain.trainer.run.generations import decode_valid
from scaletrain.utils.typed_config import ConfigError
from scaletrain.workers.rm_config import serves_judge

if TYPE_CHECKING:  # the reward-model checks here run before Ray, without the workers' imports
    from scaletrain.reward.remote_rm import RemoteRewardModel
    from scaletrain.workers.roles import RewardModelRole


class RewardWithRM:
    """Called like a reward manager (``reward(batch, return_dict=True)``): the reward model's score, alone or added
    to ``rule_fn``'s (None: the RM's score replaces the rule reward), each times its weight
    (``reward.reward_model_weight``, ``reward.rule_weight``). Adds ``rm_scores`` to the batch."""

    def __init__(
        self, reward_model: RewardModelRole | RemoteScores, rule_fn, weights: tuple[float, float] = (1.0, 1.0)
    ) -> None:
        self.reward_model, self.rule_fn, self.weights = reward_model, rule_fn, weights

    def __call__(self, batch: DataProto, return_dict: bool = False):
        batch.union(self.reward_model.compute_rm_score(batch))
        rule = self.rule_fn(batch, return_dict=True) if self.rule_fn is not None else None
        reward = combine_rewards(batch.tensors["rm_scores"], rule, self.weights)
        if isinstance(self.reward_model, RemoteScores):
            reward["metrics"].update(self.reward_model.client.metrics())
        return reward if return_dict else reward["reward_tensor"]


class RemoteScores:
    """A reward model served over HTTP (``reward.remote_rm``, scaletrain/reward/remote_rm.py) in the reward-model
    role's shape: ``compute_rm_score(batch)`` sends each row's decoded prompt, prompt + response and ground truth,
    and places the reply's reward at the row's last valid response token (``rm_scores``)."""

    def __init__(self, client: RemoteRewardModel, tokenizer: Any) -> None:
        self.client, self.tokenizer = client, tokenizer

    def compute_rm_score(self, batch: DataProto) -> DataProto:
        from scaletrain.workers.reward_model import place_at_last_token

        prompts, responses = batch.tensors["prompts"], batch.tensors["responses"]
        mask = batch.tensors["attention_mask"]
        response_mask = mask[:, -responses.shape[1] :]
        prompt_texts = decode_valid(self.tokenizer, prompts, mask[:, : prompts.shape[1]])
        response_texts = decode_valid(self.tokenizer, responses, response_mask)
        rows = batch.non_tensor_batch.get("reward_model")
        labels = (
            [row.get("ground_truth") if isinstance(row, dict) else None for row in rows] if rows is not None else None
        )
        labels = labels or [None] * len(batch)
        queries = [p + r for p, r in zip(prompt_texts, response_texts, strict=True)]
        scores = torch.tensor(self.client.score(queries, prompt_texts, labels), dtype=torch.float32)
        return DataProto.from_dict({"rm_scores": place_at_last_token(scores, response_mask)})


def combine_rewards(
    rm_scores: torch.Tensor, rule: dict[str, Any] | None, weights: tuple[float, float] = (1.0, 1.0)
) -> dict[str, Any]:
    """``rm_scores`` (B, R) alone (``rule`` None) or added to the rule reward, each times its weight (``weights``:
    the rule's, the reward model's); both sit on each row's last valid response token. The extra info keeps each
    component unweighted (``rule_score``, ``rm_score``)."""
    rule_weight, rm_weight = weights
    per_row = rm_scores.sum(-1)
    metrics = {
        "reward_model/score/mean": per_row.mean().item(),
        "reward_model/score/max": per_row.max().item(),
        "reward_model/score/min": per_row.min().item(),
    }
    if rule is None:
        return {
            "reward_tensor": rm_scores * rm_weight,
            "reward_extra_info": {"rm_score": per_row.tolist()},
            "metrics": metrics,
        }
    rule_score = rule["reward_tensor"].sum(-1).tolist()  # each component logged: the judge-vs-rule health signal
    extra = {**rule.get("reward_extra_info", {}), "rm_score": per_row.tolist(), "rule_score": rule_score}
    return {
        "reward_tensor": rule["reward_tensor"] * rule_weight + rm_scores.to(rule["reward_tensor"].dtype) * rm_weight,
        "reward_extra_info": extra,
        "metrics": {**rule["metrics"], **metrics},
    }


# ------------------------------------------------------------------------------------------------- checks
def validate_reward_model(cfg) -> None:
    """``reward_model.*`` before Ray: a sequence-classification checkpoint, positive batch keys, a tokenizer the RM
    can read the rollouts with (the policy's vocabulary, or re-tokenization), a model megatron maps."""
    rm = cfg.reward_model
    if not rm.enable or serves_judge(rm):  # a generative judge: reward_checks.py
        return
    if not rm.model.path:
        raise ConfigError(
            "reward_model.enable needs reward_model.model.path (an HF sequence-classification model, or a causal LM "
            "served as a judge with reward_model.rollout.name)"
        )
    for key in ("micro_batch_size_per_gpu", "forward_max_token_len_per_gpu"):
        if getattr(rm, key) <= 0:
            raise ConfigError(f"reward_model.{key} must be positive, got {getattr(rm, key)}")
    if rm.max_length is not None and rm.max_length <= 0:
        raise ConfigError(f"reward_model.max_length must be positive or null, got {rm.max_length}")
    hf_config = _sequence_classifier_config(rm.model)
    _validate_tokenizers(cfg)
    _validate_rm_engine_settings(cfg, hf_config)


def _sequence_classifier_config(model):
    for key, path in (
        ("reward_model.model.path", model.path),
        ("reward_model.model.input_tokenizer", model.input_tokenizer),
    ):
        if path is not None and not os.path.exists(path):
            raise ConfigError(f"{key}: not found: {path}")
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"reward_model.model.path: no HF model config in {model.path}: {exc}") from exc
    archs = getattr(hf_config, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        kind = ", ".join(archs) or "model without an architecture"
        raise ConfigError(
            f"reward_model.model.path: {model.path} is a {kind}; the reward model must be a "
            "*ForSequenceClassification checkpoint (its head, 'score', is read at each sequence's "
            "last token), or a generative judge served by a rollout engine: set reward_model.rollout.name=vllm | hf"
        )
    if getattr(hf_config, "num_labels", 1) != 1:
        raise ConfigError(
            f"reward_model.model.path: {model.path} has num_labels={hf_config.num_labels}; "
            "a reward model gives one score (num_labels=1)"
        )
    return hf_config


def _tokenizer(path: str | None, key: str, trust_remote_code: bool):
    """The tokenizer at ``path``; null: the embedded default's (the policy when actor_rollout_ref.model.path is
    null)."""
    if path is None:
        from scaletrain.data.tokenizer import build_arithmetic_tokenizer

        return build_arithmetic_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{key}: no tokenizer could be loaded from {path}: {exc}") from exc


def _vocab_difference(a, b) -> str | None:
    """None if the two tokenizers map every token to the same id; otherwise what differs."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va == vb:
        return None
    if len(va) != len(vb):
        return f"{len(va)} vs {len(vb)} tokens"
    token = next(t for t in sorted(va) if vb.get(t) != va[t])
    return f"token {token!r} has id {va[token]} vs {vb.get(token)}"


def _validate_tokenizers(cfg) -> None:
    rm, trust = cfg.reward_model.model, cfg.reward_model.model.trust_remote_code
    policy = _tokenizer(cfg.actor_rollout_ref.model.path, "actor_rollout_ref.model.path", trust)
    rm_tok = _tokenizer(rm.path, "reward_model.model.path (the RM's tokenizer)", trust)
    if rm.input_tokenizer is None:
        diff = _vocab_difference(policy, rm_tok)
        if diff is not None:
            raise ConfigError(
                f"reward_model.model.path: the reward model's tokenizer differs from the policy's ({diff}), so it "
                f"cannot read the policy's token ids; set reward_model.model.input_tokenizer to the policy's "
                f"tokenizer (e.g. actor_rollout_ref.model.path) to decode each rollout and re-tokenize it with the "
                f"reward model's chat template"
            )
        return
    diff = _vocab_difference(policy, _tokenizer(rm.input_tokenizer, "reward_model.model.input_tokenizer", trust))
    if diff is not None:
        raise ConfigError(
            f"reward_model.model.input_tokenizer: must be the policy's tokenizer (the one its tokens "
            f"are decoded with), but its vocabulary differs ({diff})"
        )
    if not getattr(rm_tok, "chat_template", None):
        raise ConfigError(
            f"reward_model.model.input_tokenizer is set, so rollouts are re-rendered with the reward "
            f"model's chat template, but the tokenizer in {rm.path} has none"
        )
    if not getattr(cfg.data, "return_raw_chat", True):
        raise ConfigError(
            "reward_model.model.input_tokenizer re-tokenizes from the rows' chat messages: set "
            "data.return_raw_chat=true"
        )


def _validate_rm_engine_settings(cfg, hf_config) -> None:
    """The backend's own check of the RM's engine settings: it runs in the actor's processes with the actor's
    layout (resolved by the config check's _validate_engine_settings)."""
    from backends.base import check_engine_settings

    try:
        check_engine_settings(cfg.backend.name, cfg.backend.extra, cfg.world_size, hf_config)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"reward_model.model.path: {exc} (backend={cfg.backend.name}: the reward model shares the actor's "
            f"layout on {cfg.world_size} ranks)"
        ) from exc
