"""verl.utils: the helpers a verl user's code imports (metrics, dict helpers, tensordict helpers, devices, sequence
balancing, tokenizers, the RL dataset)."""

from scaletrain.compat.verl.utils.tokenizer import hf_processor, hf_tokenizer

__all__ = ["hf_processor", "hf_tokenizer"]
