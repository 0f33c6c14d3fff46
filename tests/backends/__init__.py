"""Tests of the engines in backends/ (FSDP2 training engine, batching, HF model forward)."""
