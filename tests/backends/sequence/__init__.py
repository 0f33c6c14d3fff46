"""Tests of backends/sequence/ (the packed sequence's operations: the fused LM head, Ulysses sequence parallelism)."""
