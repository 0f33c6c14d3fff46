"""A vision-language rollout batch for the engine tests: the tiny Qwen2.5-VL (scaletrain/models/tiny_vlm.py) and
prompts of the synthetic visual task with random responses, in verl's layout plus the ``multi_modal_inputs``
column; and the reference log-probs of each row from its own unpadded forward in plain transformers."""

from __future__ import annotations

import torch

from scaletrain.protocol import DataProto


def write_vlm_inputs(work, rows: int = 6, seed: int = 0) -> None:
    """The tiny VLM in ``work/vlm``, it under a value and a reward head in ``work/vlm_value`` / ``work/vlm_reward``
    and ``rows`` prompts in ``work/vlm_data``: rows - 1 of the count task (one image each) and a text-only one, for
    ``vlm_batch`` (written once, read by every rank)."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    from scaletrain.data.preprocess.visual import write_task
    from scaletrain.models.tiny_vlm import save_tiny_qwen2_5_vl

    save_tiny_qwen2_5_vl(os.path.join(work, "vlm"), seed=0)
    data = os.path.join(work, "vlm_data")
    write_task("count", data, train_size=rows - 1, test_size=1, seed=seed)
    row = {"data_source": "scaletrain/visual/count", "prompt": [{"role": "user", "content": "how many?"}]}
    pq.write_table(pa.Table.from_pylist([{**row, "reward_model": {"ground_truth": "0"}}]), f"{data}/text.parquet")
    for kind in ("value", "reward"):
        save_vlm_head_model(os.path.join(work, "vlm"), os.path.join(work, f"vlm_{kind}"), kind)


def vlm_batch(work, response_len: int = 6, seed: int = 0) -> DataProto:
    """The prompts ``write_vlm_inputs`` wrote (the last one text-only) with random text responses."""
    import os

    from scaletrain.data.rl_dataset import RLDataset
    from scaletrain.models.processor import load_processor

    processor = load_processor(os.path.join(work, "vlm"))
    files = [os.path.join(work, "vlm_data", name) for name in ("train.parquet", "text.parquet")]
    dataset = RLDataset(files, processor.tokenizer, 56, processor=processor)
    rows = len(dataset)
    prompts = dataset.get_batch(range(rows))
    g = torch.Generator().manual_seed(seed)
    first_text = len(processor.tokenizer.get_added_vocab())  # ids above the special tokens: plain characters
    responses = torch.randint(first_text, len(processor.tokenizer), (rows, response_len), generator=g)
    lengths = torch.randint(1, response_len + 1, (rows,), generator=g)
    resp_mask = (torch.arange(response_len)[None, :] < lengths[:, None]).long()
    responses = torch.where(resp_mask.bool(), responses, torch.full_like(responses, processor.tokenizer.pad_token_id))
    attention_mask = torch.cat([prompts.batch["attention_mask"], resp_mask], dim=1)
    input_ids = torch.cat([prompts.batch["input_ids"], responses], dim=1)
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": resp_mask,
            "advantages": torch.randn(rows, response_len, generator=g) * resp_mask,
            "old_log_probs": torch.zeros(rows, response_len),
        },
        non_tensors={"multi_modal_inputs": prompts.non_tensor_batch["multi_modal_inputs"]},
        meta_info={"temperature": 1.0},
    )


def row_forward(model, batch: DataProto, i: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Row ``i``'s valid ids (1, T), its response length and the model's float32 output of its own unpadded forward
    (no packing, no padding; the model derives its 3-D positions from the row's ids and image grid)."""
    mask = batch.batch["attention_mask"][i].bool()
    ids = batch.batch["input_ids"][i][mask][None, :]
    vision = batch.non_tensor_batch["multi_modal_inputs"][i]
    types = (ids == model.config.image_token_id).int()
    logits = model(input_ids=ids, mm_token_type_ids=types, **vision).logits.float()
    return ids, int(batch.batch["response_mask"][i].sum()), logits


def reference_log_probs(model, batch: DataProto) -> dict[str, torch.Tensor]:
    """Each row's log-probs and entropy of its response tokens from its own unpadded forward (no packing, no
    padding; the model derives its 3-D positions from the row's ids and image grid), over the text tokens: the
    policy never emits a vision special token (image / video pad, vision start / end)."""
    R = batch.batch["responses"].shape[1]
    log_probs, entropy = torch.zeros(len(batch), R), torch.zeros(len(batch), R)
    for i in range(len(batch)):
        ids, n, logits = row_forward(model, batch, i)
        logits = logits[0, -n - 1 : -1]
        special = {
            getattr(model.config, f"{name}_token_id") for name in ("image", "video", "vision_start", "vision_end")
        }
        keep = torch.tensor([t for t in range(logits.shape[-1]) if t not in special])  # the text tokens
        column = torch.full((logits.shape[-1],), -1, dtype=torch.long)
        column[keep] = torch.arange(len(keep))  # a token's column among the kept ones
        logp = torch.log_softmax(logits[:, keep], -1)
        log_probs[i, :n] = logp.gather(-1, column[ids[0, -n:]][:, None])[:, 0]
        entropy[i, :n] = -(logp.exp() * logp).sum(-1)
    return {"log_probs": log_probs, "entropy": entropy}


def save_vlm_head_model(source, path, kind: str, seed: int = 3) -> str:
    """The VLM at ``source`` under a value ("value": a value per token) or reward ("reward": a score per sequence)
    head (backends.vision.head_model_class; weights large enough that rows differ visibly), with its processor,
    saved at ``path``; returns it."""
    from transformers import AutoConfig

    from backends.vision import head_model_class
    from scaletrain.models.processor import load_processor

    source, path = str(source), str(path)
    config = AutoConfig.from_pretrained(source, num_labels=1)
    model = head_model_class(config, kind).from_pretrained(source, config=config)
    torch.manual_seed(seed)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    model.save_pretrained(path)
    load_processor(source).save_pretrained(path)
    return path


def reference_head_outputs(model, batch: DataProto) -> dict[str, torch.Tensor]:
    """A value model's values (B, R: the head's output at the position before each response token) or a reward
    model's scores (B,: transformers' sequence classifier, pooled at the last token) of each row from its own
    unpadded forward in plain transformers."""
    R = batch.batch["responses"].shape[1]
    values, scores = torch.zeros(len(batch), R), torch.zeros(len(batch))
    for i in range(len(batch)):
        _, n, logits = row_forward(model, batch, i)
        if logits.dim() == 3:  # a token classifier: (1, T, 1)
            values[i, :n] = logits[0, -n - 1 : -1, 0]
        else:  # a sequence classifier: (1, 1)
            scores[i] = logits[0, 0]
    return {"values": values, "scores": scores}
