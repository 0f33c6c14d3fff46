"""The offline converter (scaletrain/model_merger) against the engine that wrote the checkpoint, inside an engine
test's ranks: ``engine.save`` (collective) -> ``merge`` on rank 0 alone, in-process with no process group taking
part (as a user runs it on one machine) -> the HF model's tensors equal the engine's export bit for bit, and its
log-probs (values, for a critic) the engine's own forward's (fp32, <= 1e-5)."""

from __future__ import annotations

import os

import torch

from tests.backends.multirank import assert_close


def assert_converts(engine, share, work: str, rank: int, kind: str = "causal_lm") -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from scaletrain.model_merger import merge
    from tests.backends import reference as ref

    ckpt, out = os.path.join(work, "ckpt"), os.path.join(work, "converted")
    engine.save(ckpt)
    weights = {k: v for bucket in engine.export_weights(1 << 30) for k, v in bucket}  # collective
    key = "log_probs" if kind == "causal_lm" else "values"
    own = engine.forward(share, (key,)).batch[key]
    if rank == 0:
        merge(ckpt, out, shard_bytes=1 << 16)  # small shards: several buckets, an index
        model_class = AutoModelForCausalLM if kind == "causal_lm" else AutoModelForTokenClassification
        model = model_class.from_pretrained(out, dtype=torch.float32)
        state = model.state_dict()
        assert sorted(state) == sorted(weights), sorted(set(state) ^ set(weights))
        unequal = [k for k, v in weights.items() if not torch.equal(state[k], v)]
        assert not unequal, f"converted tensors differ from the engine's export: {unequal[:4]}"
        with torch.no_grad():
            outputs = ref.ref_outputs(model, share) if kind == "causal_lm" else ref.ref_values(model, share)
        assert_close(outputs[key], own, f"converted model's {key}", tol=1e-5)
    dist.barrier()
