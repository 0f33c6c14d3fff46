"""Operations on a micro-batch's packed token sequence (layer 1), shared by the HF-model engines: the LM head fused
with the log-probs and entropy (response_head.py) and Ulysses sequence parallelism (ulysses.py)."""
