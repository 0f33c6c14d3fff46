"""Engines (layer 1): training engines (fsdp/, deepspeed/, megatron/) and rollout engines (vllm, hf).

A backend knows nothing about Ray or the trainer; it imports only scaletrain.protocol and scaletrain.algos.
"""
