"""The pipeline's stages, named once: their order, the image each runs in and its Python module.

Everything else (manifest schema, pipeline config, SageMaker sections, image builds, backends)
derives its stage list from here. The `model` stage (base model import) has no image of its own: it
needs torch, transformers and gguf, so it runs in the cpt image with its module selected by
`DILFORGE_STAGE_MODULE` (see docker/entrypoint.py).
"""

from __future__ import annotations

from typing import Literal, get_args

StageName = Literal["model", "tokenizer", "cpt", "sft", "eval"]
STAGES: tuple[StageName, ...] = get_args(StageName)  # pipeline order

ImageName = Literal["tokenizer", "cpt", "sft", "eval"]
IMAGES: tuple[ImageName, ...] = get_args(ImageName)  # one container image each

STAGE_IMAGES: dict[StageName, ImageName] = {"model": "cpt", "tokenizer": "tokenizer", "cpt": "cpt", "sft": "sft",
                                            "eval": "eval"}
STAGE_MODULES: dict[StageName, str] = {"model": "dilforge_cpt.import_model", "tokenizer": "dilforge_tokenizer",
                                       "cpt": "dilforge_cpt", "sft": "dilforge_sft", "eval": "dilforge_eval"}


def image_of(stage: str) -> ImageName:
    """The image a stage runs in (its own, except the model stage: the cpt image)."""
    return STAGE_IMAGES[stage]
