"""verl's RL dataset API over scaletrain's (``scaletrain.compat.verl.utils.dataset``): ``RLHFDataset`` built from
verl's arguments and a ``data`` config section, batched by a torch DataLoader with verl's ``collate_fn`` (a dict,
not a DataProto), on the embedded task's parquet and tokenizer; what it cannot do yet is refused, naming it; with a
vision-language model's processor it loads rows with images."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from scaletrain.compat.verl import DataProto
from scaletrain.compat.verl.utils import hf_processor, hf_tokenizer
from scaletrain.compat.verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
from scaletrain.utils.errors import InvalidInput


def test_a_verl_dataset_and_loader_on_scaletrains_data(task):
    tokenizer = hf_tokenizer(task["model"])
    assert hf_processor(task["model"]) is None  # a text-only model
    config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 32, "filter_overlong_prompts_workers": 2})
    dataset = RLHFDataset(data_files=task["train"], tokenizer=tokenizer, config=config, max_samples=20)
    assert len(dataset) == 20
    batch = next(iter(DataLoader(dataset, batch_size=8, shuffle=True, drop_last=True, collate_fn=collate_fn)))
    assert isinstance(batch, dict) and batch["input_ids"].shape == (8, 32)
    assert batch["data_source"].shape == (8,) and isinstance(batch["reward_model"][0], dict)
    assert "raw_prompt" not in batch  # verl's default: return_raw_chat false
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    data = DataProto.from_dict(tensors=tensors, non_tensors={k: v for k, v in batch.items() if k not in tensors})
    assert len(data) == 8
    with_chat = RLHFDataset(task["train"], tokenizer, OmegaConf.create({"return_raw_chat": True, "max_samples": 3}))
    assert len(with_chat) == 3 and isinstance(collate_fn([with_chat[0]])["raw_prompt"][0], list)


def test_what_it_cannot_do_is_refused_by_name(task, tmp_path):
    tokenizer = hf_tokenizer(task["model"])
    with pytest.raises(InvalidInput, match=r"config keys \['tool_config_path'\] are not supported"):
        RLHFDataset(task["train"], tokenizer, {"tool_config_path": "tools.yaml"})
    table = pq.read_table(task["train"]).slice(0, 4)
    images = pa.array([[{"bytes": b"", "path": "a.png"}]] * 4)
    pq.write_table(table.append_column("images", images), tmp_path / "mm.parquet")
    with pytest.raises(ValueError, match=r"mm.parquet: row 0: column 'images': images need a model with a processor"):
        RLHFDataset(str(tmp_path / "mm.parquet"), tokenizer, {})
    assert collate_fn([{"x": torch.ones(2), "tags": ["a"]}, {"x": torch.zeros(2), "tags": ["b", "c"]}])[
        "tags"
    ].tolist() == [["a"], ["b", "c"]]
    assert np.asarray(collate_fn([{"x": torch.ones(1)}])["x"]).shape == (1, 1)


def test_a_verl_dataset_with_a_processor_loads_images(tmp_path):
    """verl's multimodal path: hf_processor of a vision-language model, RLHFDataset(..., processor=...) over rows in
    verl's image format, verl's collate_fn."""
    from scaletrain.data.preprocess import visual
    from scaletrain.models.prepare import prepare_model

    model = prepare_model("tiny-qwen2.5-vl", tmp_path / "vlm")
    processor = hf_processor(model)
    assert processor is not None
    task = visual.write_task("taller", str(tmp_path / "taller"), train_size=6, test_size=2)
    config = OmegaConf.create({"max_prompt_length": 64, "image_key": "images", "return_raw_chat": True})
    dataset = RLHFDataset(task["train"], hf_tokenizer(model), config, processor=processor)
    batch = collate_fn([dataset[0], dataset[1]])
    assert batch["multi_modal_inputs"][0]["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert len(batch["multi_modal_data"][1]["image"]) == 1 and batch["input_ids"].shape == (2, 64)
