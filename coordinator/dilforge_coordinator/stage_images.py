"""The container image each stage runs in."""

from __future__ import annotations

from typing import Literal, get_args

ImageName = Literal["curate", "tokenizer", "cpt", "sft", "eval"]
IMAGES: tuple[ImageName, ...] = get_args(ImageName)  # one container image each


def image_of(stage: str) -> ImageName:
    """Its own, except the model stage (base model import), which needs torch, transformers and gguf: the cpt
    image, its module selected by `DILFORGE_STAGE_MODULE` (docker/entrypoint.py)."""
    image = "cpt" if stage == "model" else stage
    if image not in IMAGES:
        raise ValueError(f"{stage!r} is not a pipeline stage (stages: model, {', '.join(IMAGES)})")
    return image
