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

STAGE_IMAGES: dict[StageName, ImageName] = {
    "model": "cpt",
    "tokenizer": "tokenizer",
    "cpt": "cpt",
    "sft": "sft",
    "eval": "eval",
}
STAGE_MODULES: dict[StageName, str] = {
    "model": "dilforge_cpt.import_model",
    "tokenizer": "dilforge_tokenizer",
    "cpt": "dilforge_cpt",
    "sft": "dilforge_sft",
    "eval": "dilforge_eval",
}


def image_of(stage: str) -> ImageName:
    """The image a stage runs in (its own, except the model stage: the cpt image)."""
    return STAGE_IMAGES[stage]


# (cpt 2: transplant step-0 BPB published as maps per method, typed by metrics.Transplant; tokenizer 2: extend learns
# no digit merges by default, digit_tokens: as_base; sft 2: its metric
# gradient_checkpointing is activation_checkpointing, the shared knob's name.)
# Code version of each stage: part of its artifact id and recorded in its manifest (`code_version`). Bump a stage's
# number in the same commit as any change to its code that changes what it publishes for the same config and inputs
# (a fixed transplant, another default inside the code, a new file in the artifact): reruns then build new artifacts
# instead of reusing what the old code produced. tests/unit/test_stage_golden.py holds each stage's output on a tiny
# pipeline and fails, naming the stage to bump, when the output changes under an unchanged version. Refactors that
# publish the same bytes keep the number.
STAGE_VERSIONS: dict[StageName, int] = {"model": 2, "tokenizer": 2, "cpt": 2, "sft": 2, "eval": 1}
