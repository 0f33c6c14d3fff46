"""A model directory's multimodal processor (outside the layers, beside the model preparation): the data layer and
the agent loops turn images and text into token ids and vision inputs with it.

``load_processor(path)`` is ``transformers.AutoProcessor`` for a model directory that has a processor
(``preprocessor_config.json`` or ``processor_config.json``), None for a text-only one. transformers builds a
Qwen2-VL family processor with a video processor, which needs torchvision; where torchvision cannot be imported
(this project's CPU install: the index's torchvision is a CUDA build that breaks ``import transformers``), the same
processor is built for images only (``*ImagesOnlyProcessor``: identical image and text handling, videos refused),
with a warning. A model of another family without torchvision raises, naming the missing package.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

logger = logging.getLogger(__name__)

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


class _ImagesOnly:
    """A Qwen2-VL family processor without its video processor: the attributes transformers derives from this
    ``__init__`` are the image processor and the tokenizer."""

    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None = None, **kwargs: Any):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)  # pyright: ignore

    def __call__(self, *args, videos=None, **kwargs):
        if videos is not None:
            raise ValueError("videos need torchvision (transformers' video processor); this processor takes images")
        return super().__call__(*args, **kwargs)  # pyright: ignore[reportAttributeAccessIssue]


class Qwen2VLImagesOnlyProcessor(_ImagesOnly, Qwen2VLProcessor):
    pass


class Qwen2_5_VLImagesOnlyProcessor(_ImagesOnly, Qwen2_5_VLProcessor):
    pass


IMAGES_ONLY = {"qwen2_vl": Qwen2VLImagesOnlyProcessor, "qwen2_5_vl": Qwen2_5_VLImagesOnlyProcessor}


def has_processor(path: str | Path) -> bool:
    """Whether ``path`` (a local model directory) ships processor settings (a multimodal model)."""
    return any((Path(path) / name).is_file() for name in PROCESSOR_FILES)


def load_processor(path: str | Path, trust_remote_code: bool = False) -> Any | None:
    """The processor of the model at ``path`` (see the module docstring), or None for a text-only model."""
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

    if not has_processor(path):
        return None
    if importlib.util.find_spec("torchvision") is not None:
        return AutoProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    model_type = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code).model_type
    if model_type not in IMAGES_ONLY:
        raise ModuleNotFoundError(
            f"the processor of {path} (model_type {model_type}) needs torchvision, which is not installed; "
            f"without it the Qwen2-VL family's processors ({', '.join(IMAGES_ONLY)}) are built for images only"
        )
    logger.warning("torchvision is not installed: %s's processor takes images, not videos", path)
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    image_processor = AutoImageProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    template = Path(path) / "chat_template.jinja"
    chat_template = template.read_text() if template.is_file() else tokenizer.chat_template
    return IMAGES_ONLY[model_type](image_processor, tokenizer, chat_template=chat_template)
