"""Multimodal RL data: the tiny Qwen2.5-VL and its processor (scaletrain/models/tiny_vlm.py, processor.py), the
synthetic visual tasks (scaletrain/data/preprocess/visual.py) and their scorer, and RLDataset on rows with images
(scaletrain/data/vision.py): vision tokens in the prompt ids, the processor's inputs per row, a geo3k-format
parquet, and bad images refused naming the file, row, column and image."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from scaletrain.data.preprocess import visual
from scaletrain.data.rl_dataset import RLDataset
from scaletrain.models.processor import load_processor
from scaletrain.reward.scorers import default_compute_score


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from scaletrain.models.prepare import prepare_model

    return prepare_model("tiny-qwen2.5-vl", tmp_path_factory.mktemp("vlm") / "tiny")


@pytest.fixture(scope="module")
def processor(vlm_dir):
    return load_processor(vlm_dir)


@pytest.fixture(scope="module")
def count_task(tmp_path_factory):
    return visual.write_task("count", str(tmp_path_factory.mktemp("count")), train_size=40, test_size=10, seed=3)


def png(colour=(255, 0, 0), size=(56, 56)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def image_row(content="<image>how many red?", images=None, **extra):
    return {
        "data_source": "scaletrain/visual/count",
        "prompt": [{"role": "user", "content": content}],
        "images": [{"bytes": png(), "path": None}] if images is None else images,
        "reward_model": {"style": "rule", "ground_truth": "1"},
        **extra,
    }


def write(rows, path) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_the_tiny_vlm_loads_with_its_processor_and_runs(vlm_dir, processor):
    from transformers import AutoConfig, AutoModelForImageTextToText

    assert AutoConfig.from_pretrained(vlm_dir).model_type == "qwen2_5_vl"
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many red?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    encoded = processor(text=[text], images=[Image.new("RGB", (56, 56))], return_tensors="pt")
    image_tokens = int((encoded["input_ids"] == model.config.image_token_id).sum())
    assert image_tokens == int(encoded["image_grid_thw"].prod()) // 4 == 4  # 56 px: 4 x 4 patches, merged 2 x 2
    with torch.no_grad():
        logits = model(**encoded).logits
    assert logits.shape == (1, encoded["input_ids"].shape[1], len(processor.tokenizer))
    with pytest.raises(ValueError, match="videos need torchvision"):
        processor(text=[text], videos=[[Image.new("RGB", (56, 56))]])


def test_a_text_model_has_no_processor(tmp_path):
    from scaletrain.data import build_embedded_default

    assert (
        load_processor(build_embedded_default(cache_dir=str(tmp_path), n_train=8, n_val=4, n_test=4)["model"]) is None
    )


def test_the_visual_tasks_rows_and_scorer(count_task):
    rows = pq.read_table(count_task["train"]).to_pylist()
    test = pq.read_table(count_task["test"]).to_pylist()
    assert len(rows) == 40 and len(test) == 10
    row = rows[0]
    assert row["data_source"] == "scaletrain/visual/count" and row["prompt"][0]["content"].startswith(
        "<image>how many "
    )
    assert set(row["images"][0]) == {"bytes", "path"} and row["images"][0]["bytes"].startswith(b"\x89PNG")
    # disjoint splits
    assert not {r["images"][0]["bytes"] for r in rows} & {r["images"][0]["bytes"] for r in test}
    answer = row["reward_model"]["ground_truth"]
    assert default_compute_score(row["data_source"], answer, answer, {"response_ended_with_eos": True}) == 1.0
    assert default_compute_score(row["data_source"], answer + "0", answer) == 0.0
    assert default_compute_score(row["data_source"], answer, answer, {"response_ended_with_eos": False}) == 0.0
    for task in ("taller", "number", "colour"):
        (drawn,) = visual.build_splits(task, 1, 0, seed=1)["train"]
        assert drawn["reward_model"]["ground_truth"] in {"left", "right", *map(str, range(10)), *visual.MORE_COLOURS}
    # colour: the shape's pixels are the answer's colour
    from PIL import Image

    for row in visual.build_splits("colour", 5, 0, seed=2)["train"]:
        image = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")
        colours = {c for _, c in image.getcolors(1 << 16)} - {(255, 255, 255)}
        assert colours == {visual.MORE_COLOURS[row["reward_model"]["ground_truth"]]}, colours


def test_rows_with_images_carry_vision_tokens_and_inputs(count_task, processor):
    ds = RLDataset(count_task["train"], processor.tokenizer, 64, processor=processor)
    item = ds[0]
    inputs = item["multi_modal_inputs"]
    grid = inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 8, 8]] and inputs["pixel_values"].shape == (64, 3 * 2 * 14 * 14)
    pad_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert item["raw_prompt_ids"].count(pad_id) == 16  # 8 x 8 patches merged 2 x 2
    assert int((item["input_ids"] == pad_id).sum()) == 16 and item["attention_mask"].sum() == len(
        item["raw_prompt_ids"]
    )
    assert item["raw_prompt"][0]["content"][0] == {"type": "image"}
    (image,) = item["multi_modal_data"]["image"]
    assert image.size == (112, 112) and image.mode == "RGB"
    batch = ds.get_batch([0, 1, 2])
    assert batch.non_tensor_batch["multi_modal_inputs"].shape == (3,)
    # the processor's inputs for the row, the same as a direct call gives
    direct = processor(
        text=[processor.apply_chat_template(item["raw_prompt"], add_generation_prompt=True, tokenize=False)],
        images=[image],
        return_tensors="pt",
    )
    torch.testing.assert_close(inputs["pixel_values"], direct["pixel_values"])
    assert direct["input_ids"][0].tolist() == item["raw_prompt_ids"]


def test_max_prompt_length_counts_vision_tokens(tmp_path, processor):
    path = write([image_row(), image_row(content="how many?", images=[])], tmp_path / "mixed.parquet")
    text_only = len(RLDataset(path, processor.tokenizer, 64, processor=processor)[1]["raw_prompt_ids"])
    # room for the text row, not for the image row's 4 vision tokens + its text
    ds = RLDataset(path, processor.tokenizer, text_only + 2, processor=processor, filter_overlong_prompts=True)
    assert len(ds) == 1 and ds.num_filtered == 1 and ds[0]["multi_modal_inputs"] == {}
    with pytest.raises(ValueError, match=r"mixed\.parquet: row 0: .*a prompt with images cannot be truncated"):
        RLDataset(path, processor.tokenizer, text_only + 2, processor=processor, truncation="left")


def test_a_geo3k_format_parquet_loads(tmp_path, processor):
    """The file verl's examples/data_preprocess/geo3k.py writes (HF datasets' parquet: the images a list of
    struct<bytes, path>, the features in the schema's metadata), with a problem that holds its own <image>."""
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("images", pa.list_(image)),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct([("answer", pa.string()), ("index", pa.int64()), ("question", pa.string()),
                                      ("split", pa.string())])),
        ],
        metadata={b"huggingface": json.dumps({"info": {"features": {"images": [{"_type": "Image"}]}}}).encode()},
    )  # fmt: skip
    problem = "<image>Find x. Round to the nearest tenth."
    rows = [
        {
            "data_source": "hiyouga/geometry3k",
            "prompt": [{"content": problem + " The final answer MUST BE put in \\boxed{}.", "role": "user"}],
            "images": [{"bytes": png((0, 0, 255), (84, 140)), "path": "img_0.png"}],
            "ability": "math",
            "reward_model": {"ground_truth": "3.5", "style": "rule"},
            "extra_info": {"answer": "3.5", "index": i, "question": problem, "split": "train"},
        }
        for i in range(2)
    ]
    path = tmp_path / "geo3k_train.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    ds = RLDataset(str(path), processor.tokenizer, 128, processor=processor)
    assert len(ds) == 2 and ds[1]["index"] == 1
    assert ds[0]["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 10, 6]]  # 140 x 84 -> 10 x 6 patches


def broken_files(tmp_path) -> dict[str, tuple[list[dict], str]]:
    """Per case: the rows of a file (a good row first: its image a path beside the parquet file) and the error."""
    (tmp_path / "ok.png").write_bytes(png())
    ok = image_row(images=[{"bytes": None, "path": "ok.png"}])
    two = [{"bytes": png(), "path": None}, {"bytes": b"not an image", "path": None}]
    return {
        "undecodable bytes": (
            [ok, image_row("<image><image>how many?", images=two)],
            r"row 1: column 'images'\[1\]: cannot decode the image from its bytes",
        ),
        "missing file": (
            [ok, image_row(images=[{"bytes": None, "path": "nope.png"}])],
            r"row 1: column 'images'\[0\]: image file not found: .*nope\.png",
        ),
        "placeholders do not match": (
            [ok, image_row("<image><image>x")],
            r"row 1: prompt: the prompt has 2 <image> placeholders for 1 images",
        ),
        # a parquet column has one type: this file's images are plain strings
        "not a list": ([image_row(images="ok.png")], r"row 0: column 'images': expected a list of images"),
    }


def sft_rows(path, processor, max_prompt_length=64, with_processor=True, **kwargs):
    """The SFT dataset on RL-format rows, the answers as the responses (the processor given, or the tokenizer only)."""
    from scaletrain.data.sft_dataset import SFTDataset

    if with_processor:
        kwargs["processor"] = processor
    return SFTDataset(path, processor.tokenizer, "prompt", "reward_model.ground_truth", max_prompt_length, 4, **kwargs)


@pytest.mark.parametrize("dataset", ["rl", "sft"])
@pytest.mark.parametrize("case", ["undecodable bytes", "missing file", "placeholders do not match", "not a list"])
def test_bad_images_are_refused_naming_file_row_column_and_image(tmp_path, processor, case, dataset):
    rows, message = broken_files(tmp_path)[case]
    path = write(rows, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=rf"bad\.parquet: {message}"):
        if dataset == "rl":
            RLDataset(path, processor.tokenizer, 128, processor=processor)
        else:
            sft_rows(path, processor, 128)


def test_sft_rows_with_images_render_as_the_rl_prompts(count_task, processor):
    """SFT on the task's RL parquet (the answers as responses): each prompt's ids and vision inputs are the RL
    dataset's, the response the answer and EOS; images without a processor and an image prompt over
    max_prompt_length (never truncated) are refused naming the row."""
    rl = RLDataset(count_task["train"], processor.tokenizer, 64, processor=processor)
    sft = sft_rows(count_task["train"], processor, truncation="truncate")
    batch = sft.get_batch([0, 1])
    tok = processor.tokenizer
    for row in (0, 1):
        prompt_mask = batch.batch["attention_mask"][row, :64].bool()
        assert batch.batch["input_ids"][row, :64][prompt_mask].tolist() == rl[row]["raw_prompt_ids"]
        inputs = batch.non_tensor_batch["multi_modal_inputs"][row]
        torch.testing.assert_close(inputs["pixel_values"], rl[row]["multi_modal_inputs"]["pixel_values"])
        response = batch.batch["responses"][row][batch.batch["response_mask"][row].bool()]
        assert tok.decode(response) == rl.rows[row]["reward_model"]["ground_truth"] + tok.eos_token
    with pytest.raises(ValueError, match=r"train\.parquet: row 0: column 'images': images need a model with a proc"):
        sft_rows(count_task["train"], processor, with_processor=False)
    with pytest.raises(ValueError, match=r"train\.parquet: row 0: .* tokens exceed .*never truncated"):
        sft_rows(count_task["train"], processor, 20, truncation="truncate")


def test_images_without_a_processor_and_videos_are_refused(tmp_path, processor):
    path = write([image_row()], tmp_path / "img.parquet")
    with pytest.raises(ValueError, match=r"img\.parquet: row 0: column 'images': images need a model with a processor"):
        RLDataset(path, processor.tokenizer, 64)
    videos = write([{**image_row(), "videos": [{"path": "a.mp4"}]}], tmp_path / "vid.parquet")
    with pytest.raises(ValueError, match=r"vid\.parquet: row 0: column 'videos': videos and audio are not supported"):
        RLDataset(videos, processor.tokenizer, 64, processor=processor)
    # a video column that is empty in a row is no video
    empty = write([{**image_row(), "videos": None}], tmp_path / "novid.parquet")
    assert np.asarray(RLDataset(empty, processor.tokenizer, 64, processor=processor)[0]["input_ids"]).shape == (64,)


def test_a_left_padded_batch_gives_each_rows_own_logits(count_task, vlm_dir, processor):
    """The dataset's layout (left-padded ids, text position ids, per-row vision inputs concatenated in row order)
    feeds the model: given which tokens are image tokens (``mm_token_type_ids``, 1 where the id is the image pad:
    it follows from the ids), it derives each row's 3-D (M-RoPE) positions from the ids, the grid and the mask, and
    every row's logits equal its own unpadded forward; without them the vision tokens would get 1-D positions."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()
    ds = RLDataset(count_task["train"], processor.tokenizer, 64, processor=processor)
    batch = ds.get_batch([0, 1, 2])
    inputs = batch.non_tensor_batch["multi_modal_inputs"]
    ids, image = batch.batch["input_ids"], model.config.image_token_id
    vision = {
        "pixel_values": torch.cat([x["pixel_values"] for x in inputs]),
        "image_grid_thw": torch.cat([x["image_grid_thw"] for x in inputs]),
    }
    with torch.no_grad():
        padded = model(
            input_ids=ids,
            attention_mask=batch.batch["attention_mask"],
            mm_token_type_ids=(ids == image).int(),
            **vision,
        ).logits
        flat = model(input_ids=ids, attention_mask=batch.batch["attention_mask"], **vision).logits
        for i in range(3):
            row = torch.tensor([ds[i]["raw_prompt_ids"]])
            own = model(input_ids=row, mm_token_type_ids=(row == image).int(), **inputs[i]).logits[0]
            torch.testing.assert_close(padded[i, -row.shape[1] :], own, atol=1e-5, rtol=0)
            assert (flat[i, -row.shape[1] :] - own).abs().max() > 1e-3  # the 3-D positions matter
