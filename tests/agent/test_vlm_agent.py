"""Images in the agent loops (scaletrain/agent): the tiny Qwen2.5-VL, the real HF rollout engine, a tool that
answers with an image. Every trajectory: the prompt's image, three model turns, two tool turns each showing the
model a new image. Token exactness with vision tokens: each model span is exactly what the engine sampled for the
sequence before it (images included), every image's vision tokens are in the ids (one pad per merged patch of the
trajectory's images, which the batch carries in order), and the trainer's forward on the assembled batch gives every
model token the rollout's log-prob; the tool's images reach the model (other pixels, other log-probs). A text
model's loop drops a tool image and counts it; an undecodable tool image answers the model with an error.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from backends.rollout.base import RolloutConfig
from backends.rollout.hf import HFRolloutEngine
from scaletrain.agent.manager import AgentLoopManager
from scaletrain.agent.server import AsyncServerManager
from scaletrain.agent.tool_parser import FunctionCall, ToolParser
from scaletrain.agent.tools.base import BaseTool, ToolResponse
from tests.agent.helpers import SpyBackend, config

COLOURS = [(220, 30, 30), (30, 170, 30), (30, 60, 220), (230, 200, 20)]


@ToolParser.register("test_always_look")
class AlwaysLook(ToolParser):
    """Every assistant turn calls ``look`` (the tiny model's characters cannot spell a hermes call)."""

    async def extract_tool_calls(self, response_ids):
        return "", [FunctionCall("look", "{}")], 0


class LookTool(BaseTool):
    """Answers with a 56 x 56 image of one colour (the n-th call of an instance's trajectory: the n-th colour), or
    with ``config.image`` as given."""

    default_schema = {"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}
    calls = 0

    async def execute(self, instance_id, parameters, **kwargs):
        from PIL import Image

        if "image" in self.config:
            return ToolResponse(text="seen", image=self.config["image"]), 0.0, {}
        LookTool.calls += 1
        image = Image.new("RGB", (56, 56), COLOURS[LookTool.calls % len(COLOURS)])
        return ToolResponse(text="seen", image=image), 0.0, {}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """The tiny VLM whose every letter also ends a turn (generation_config's EOS ids), so each turn is short and
    ends with "stop": the loop goes on to the tool."""
    from scaletrain.models.prepare import prepare_model
    from scaletrain.models.processor import load_processor

    path = prepare_model("tiny-qwen2.5-vl", tmp_path_factory.mktemp("vlm") / "tiny")
    processor = load_processor(path)
    vocab = processor.tokenizer.get_vocab()
    stops = [processor.tokenizer.eos_token_id] + [vocab[c] for c in "abcdefghijklmnopqrstuvwxyz0123456789 "]
    with open(os.path.join(path, "generation_config.json")) as f:
        generation = json.load(f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({**generation, "eos_token_id": stops}, f)
    return path, processor


def tools_file(tmp_path, **tool_config) -> str:
    path = tmp_path / "tools.yaml"
    entry = {"class_name": f"{__name__}.LookTool", "config": tool_config}
    path.write_text(json.dumps({"tools": [entry]}))  # JSON is YAML
    return str(path)


def image_rows(tmp_path, processor, n_rows: int = 3):
    from scaletrain.data.preprocess.visual import write_task
    from scaletrain.data.rl_dataset import RLDataset

    files = write_task("count", str(tmp_path / "count"), train_size=n_rows, test_size=1, seed=0)
    ds = RLDataset(files["train"], processor.tokenizer, 64, processor=processor)
    return ds.get_batch(range(n_rows))


def model_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_a_tool_answering_with_images_stays_token_exact(vlm, tmp_path):
    from backends.config import ModelConfig
    from backends.hf_model import build_model, forward_micro_batch
    from backends.vision import gather_vision_inputs

    path, processor = vlm
    engine = HFRolloutEngine(RolloutConfig(model_path=path, dtype="float32"), processor.tokenizer)
    backend = SpyBackend([engine])
    cfg = config(tools_config_file=tools_file(tmp_path), format="test_always_look", max_assistant_turns=3)
    manager = AgentLoopManager(
        cfg,
        AsyncServerManager(backend),
        processor.tokenizer,
        prompt_length=64,
        response_length=120,
        processor=processor,
    )
    out = manager.generate_sequences(image_rows(tmp_path, processor), {"temperature": 1.0, "seed": 3}, n=2)
    vision_column = out.non_tensor_batch["multi_modal_inputs"]
    pad_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    sampled: dict[tuple, list[list[int]]] = {}
    for prefix, tokens in backend.sampled:
        sampled.setdefault(tuple(prefix), []).append(tokens)
    for i in range(len(out)):
        valid = out.batch["attention_mask"][i].bool()
        ids = out.batch["input_ids"][i][valid].tolist()
        grid = vision_column[i]["image_grid_thw"]
        assert grid.shape[0] == 3, "the prompt's image and one per tool turn"
        assert ids.count(pad_id) == int(grid.prod(-1).sum()) // 4  # one pad per merged 2 x 2 patch
        P = int(out.batch["attention_mask"][i, :64].sum())
        mask = out.batch["response_mask"][i][out.batch["attention_mask"][i, 64:].bool()].tolist()
        spans = model_spans(mask)
        assert len(spans) == 3
        for s, e in spans:  # each model span: what the engine sampled for the ids before it
            assert ids[P + s : P + e] in sampled[tuple(ids[: P + s])]
        assert pad_id in ids[P + spans[0][1] : P + spans[1][0]]  # the tool turn shows an image
    # the trainer's forward on the assembled batch: the rollout's log-prob of every model token
    model = build_model(ModelConfig(path=path, dtype="float32")).eval()
    tensors = {k: out.batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")}
    model_tokens = out.batch["response_mask"].bool()
    with torch.no_grad():
        trainer = forward_micro_batch(model, tensors, ("log_probs",), vision=gather_vision_inputs(vision_column, "cpu"))
    diff = (trainer["log_probs"] - out.batch["rollout_log_probs"])[model_tokens].abs().max().item()
    print(f"agent loop with tool images: rollout vs trainer log-probs max abs diff {diff:.2e}")
    assert diff <= 1e-4
    # the tool's images reach the model: other pixels for them change the later turns' log-probs
    other = []
    for inputs in vision_column:
        pixels = inputs["pixel_values"].clone()
        pixels[64:] = -pixels[64:]  # the prompt's image is its first 64 patches; the tools' follow
        other.append({**inputs, "pixel_values": pixels})
    with torch.no_grad():
        changed = forward_micro_batch(model, tensors, ("log_probs",), vision=gather_vision_inputs(other, "cpu"))
    after_tools = model_tokens.clone()
    for i in range(len(out)):
        first_end = model_spans(out.batch["response_mask"][i].tolist())[0][1]
        after_tools[i, :first_end] = False
    assert (changed["log_probs"] - trainer["log_probs"])[after_tools].abs().max().item() > 1e-3
    assert (changed["log_probs"] - trainer["log_probs"])[model_tokens & ~after_tools].abs().max().item() < 1e-6


@pytest.mark.parametrize("case", ["text model", "bad image"])
def test_tool_images_a_loop_cannot_show_are_counted(vlm, tmp_path, case):
    """A text model's loop (no processor) drops a tool's image and counts it; an undecodable one is a tool error the
    model reads."""
    from tests.agent.helpers import ScriptedServer, make_agent_tokenizer

    path, processor = vlm
    image = None
    if case == "bad image":
        (tmp_path / "bad.png").write_bytes(b"not an image")
        image = {"path": str(tmp_path / "bad.png")}
    tok = make_agent_tokenizer() if case == "text model" else processor.tokenizer
    server = ScriptedServer(lambda rid, turn, ids: tok("0", add_special_tokens=False)["input_ids"])
    cfg = config(tools_config_file=tools_file(tmp_path, **({"image": image} if image else {})), max_assistant_turns=2)
    cfg.format = "test_always_look"
    manager = AgentLoopManager(
        cfg, server, tok, prompt_length=64, response_length=60, processor=processor if image else None
    )
    loop = manager._loop("tool_agent")
    output = asyncio.run(loop.run({}, raw_prompt=[{"role": "user", "content": "look"}], request_id="t", extra_info={}))
    tool_message = output.extra_fields["messages"][2]
    if case == "text model":
        assert output.metrics["tool_images_dropped"] == 1 and tool_message["content"] == "seen"
    else:
        assert output.metrics["tool_errors"] == 1
        assert "cannot decode the image" in tool_message["content"]
    assert output.multi_modal_inputs is None


@pytest.mark.parametrize("limit", ["max_user_turns", "response budget"])
def test_a_trajectory_ending_on_a_tool_turn_keeps_its_images(vlm, tmp_path, limit):
    """Ended by the turn limit right after a tool's image (appended), or by the budget before it (not appended):
    the ids' image pads and the trajectory's vision inputs still agree."""
    from tests.agent.helpers import ScriptedServer

    path, processor = vlm
    tok = processor.tokenizer
    server = ScriptedServer(lambda rid, turn, ids: tok("0", add_special_tokens=False)["input_ids"])
    settings = {"max_user_turns": 1} if limit == "max_user_turns" else {}
    cfg = config(tools_config_file=tools_file(tmp_path), max_assistant_turns=3, **settings)
    cfg.format = "test_always_look"
    budget = 60 if limit == "max_user_turns" else 8  # 8: no room for a tool turn holding an image's 4 pads
    manager = AgentLoopManager(cfg, server, tok, prompt_length=64, response_length=budget, processor=processor)
    row = image_rows(tmp_path, processor, 1)
    fields = {k: row.non_tensor_batch[k][0] for k in ("raw_prompt", "multi_modal_data", "multi_modal_inputs")}
    output = asyncio.run(manager._loop("tool_agent").run({}, request_id="t", extra_info={}, **fields))
    pad_id = tok.convert_tokens_to_ids("<|image_pad|>")
    pads = (output.prompt_ids + output.response_ids).count(pad_id)
    images = output.multi_modal_inputs["image_grid_thw"].shape[0]
    assert images == (2 if limit == "max_user_turns" else 1)
    assert pads == int(output.multi_modal_inputs["image_grid_thw"].prod(-1).sum()) // 4
