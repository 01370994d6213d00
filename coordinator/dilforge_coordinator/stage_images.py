"""The container image each stage runs in: one per stage, except the model stage (base model import), which needs
torch, transformers and gguf and so runs in the cpt image with its module selected by `DILFORGE_STAGE_MODULE`
(docker/entrypoint.py)."""

from __future__ import annotations

from typing import Literal, get_args

from dilforge_shared.manifest import StageName

ImageName = Literal["curate", "tokenizer", "cpt", "sft", "eval"]
IMAGES: tuple[ImageName, ...] = get_args(ImageName)  # one container image each

STAGE_IMAGES: dict[StageName, ImageName] = {
    "model": "cpt",
    "curate": "curate",
    "tokenizer": "tokenizer",
    "cpt": "cpt",
    "sft": "sft",
    "eval": "eval",
}


def image_of(stage: str) -> ImageName:
    """The image a stage runs in (its own, except the model stage: the cpt image)."""
    return STAGE_IMAGES[stage]
