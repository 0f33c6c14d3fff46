"""HF rollout engine: transformers ``generate`` behind the RolloutEngine interface (reference / debugging engine).

- ``generate``: left-padded prompts, each row repeated n times (rows i*n .. i*n+n-1), sampled with temperature /
  top-p / top-k (temperature 0 = greedy), stopping at EOS. ``rollout_log_probs`` is the log-softmax of the
  *processed* logits at each sampled token: temperature-scaled, and top-k / top-p truncated when those are on
  (exactly the distribution the token was drawn from; greedy uses the raw logits). A call with
  ``sampling.seed`` set forks and seeds torch's RNG, so same seed + same weights -> same samples, and the
  global RNG state is left untouched.
- A vision-language model (backends/vision.py) generates from the prompts' ``multi_modal_inputs`` (each row's
  pixel values, repeated with it), its 3-D positions derived from which prompt ids are image tokens; it never
  samples a vision special token (``suppress_tokens``: a generated image pad would be taken for an image).
- ``update_weights``: HF-named tensors copied into the model bucket by bucket (unknown names raise).
  ``load_format=dummy`` starts from random weights (the first update replaces them), like vLLM's.
- ``sleep`` / ``wake_up``: move the model to CPU and back when it lives on a GPU; no-op on CPU.

Memory note: ``output_scores`` keeps one (rows, vocab) float tensor per generated step; fine for tests, tiny
models and debugging, use the vLLM engine for long responses with large vocabularies.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from backends.checkpoint.hf_names import InMemoryLayout
from backends.hf_model import torch_dtype
from backends.rollout.base import WAKE_TAGS, RolloutConfig, RolloutEngine, SamplingConfig, register_rollout
from backends.rollout.layout import build_rollout_output, eos_token_ids, mask_after_eos, pad_token_id
from backends.vision import (
    MULTI_MODAL_INPUTS,
    causal_lm_class,
    check_image_tokens,
    gather_vision_inputs,
    is_vision_language,
    vision_special_tokens,
    vision_token_types,
)
from scaletrain.protocol import DataProto

GREEDY_EPS = 1e-5  # temperatures below this mean greedy decoding (same threshold as vLLM)


@register_rollout("hf")
class HFRolloutEngine(RolloutEngine):
    def __init__(self, config: RolloutConfig, tokenizer):
        from transformers import AutoConfig

        self.config = config
        self.tokenizer = tokenizer
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch_dtype(config.resolved_for(self.device.type)["dtype"])
        hf_config = AutoConfig.from_pretrained(config.model_path)
        self.vision_language = is_vision_language(hf_config)
        auto = causal_lm_class(hf_config)
        if config.load_format == "dummy":  # random weights, replaced by the first update (as vLLM's dummy loader)
            model = auto.from_config(hf_config, dtype=dtype)
        else:
            model = auto.from_pretrained(config.model_path, dtype=dtype)
        # transformers wraps ``to`` with functools.wraps(nn.Module.to), which pyright reads as unbound
        self.model = model.to(self.device).eval()  # pyright: ignore[reportArgumentType]
        self.eos_ids = eos_token_ids(tokenizer, config.model_path)
        self.pad_id = pad_token_id(tokenizer, self.eos_ids)
        self._layout = InMemoryLayout(self.model)  # synced weights arrive in the checkpoint layout

    # ------------------------------------------------------------------------------------------------ generate
    def _generation_config(self, sampling: SamplingConfig):
        from transformers import GenerationConfig

        kwargs: dict[str, Any] = dict(
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=0,
            num_beams=1,
            num_return_sequences=1,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_scores=True,
            use_cache=True,
        )
        if self.vision_language:
            kwargs["suppress_tokens"] = vision_special_tokens(self.model.config)
        if sampling.temperature < GREEDY_EPS:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(
                do_sample=True,
                temperature=float(sampling.temperature),
                top_p=float(sampling.top_p),
                top_k=int(sampling.top_k) if sampling.top_k > 0 else 0,  # 0 disables top-k in transformers
            )
        return GenerationConfig(**kwargs)

    @torch.no_grad()
    def generate(self, prompts: DataProto, sampling: SamplingConfig) -> DataProto:
        n, max_new = sampling.n, sampling.max_new_tokens
        input_ids = prompts.tensors["input_ids"].to(self.device).repeat_interleave(n, dim=0)
        attention_mask = prompts.tensors["attention_mask"].to(self.device).repeat_interleave(n, dim=0)
        vision = {}
        if self.vision_language:
            column = prompts.non_tensor_batch.get(MULTI_MODAL_INPUTS)
            vision = gather_vision_inputs(None if column is None else column.repeat(n), self.device)
            check_image_tokens(self.model.config, input_ids, vision)
            vision["mm_token_type_ids"] = vision_token_types(self.model.config, input_ids)
        prompt_len = input_ids.shape[1]
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            # transformers types generate's self as a protocol its own auto-model type does not meet
            out = self.model.generate(  # pyright: ignore[reportAttributeAccessIssue]
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=self._generation_config(sampling),
                **vision,
            )
        generated = out.sequences[:, prompt_len:]
        steps = generated.shape[1]
        responses = torch.full((generated.shape[0], max_new), self.pad_id, dtype=torch.long, device=self.device)
        responses[:, :steps] = generated
        log_probs = torch.zeros(responses.shape, dtype=torch.float32, device=self.device)
        for t, scores in enumerate(out.scores):  # processed logits of step t, (rows, vocab)
            step_lp = torch.log_softmax(scores.float(), dim=-1)
            log_probs[:, t] = step_lp.gather(1, generated[:, t : t + 1]).squeeze(1)
        response_mask = mask_after_eos(responses, self.eos_ids)
        response_mask[:, steps:] = 0
        result = build_rollout_output(prompts, responses.cpu(), response_mask.cpu(), log_probs.cpu(), n, self.pad_id)
        result.meta_info["rollout_engine"] = "hf"
        return result

    # ------------------------------------------------------------------------------------------ weights, memory
    @torch.no_grad()
    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        for bucket in buckets:
            self._layout.load(bucket)

    def sleep(self) -> None:
        if self.device.type == "cuda":
            self.model.to("cpu")  # pyright: ignore[reportArgumentType]  # transformers' wrapped ``to`` (see __init__)
            torch.cuda.empty_cache()

    def wake_up(self, tags: tuple[str, ...] = WAKE_TAGS) -> None:
        if self.device.type == "cuda" and "weights" in tags:
            self.model.to(self.device)  # pyright: ignore[reportArgumentType]  # transformers' wrapped ``to``
