"""The GPU suite (`pytest tests/gpu`, or scripts/gpu_check.sh): skipped without CUDA, but for the
rehearsal checks.

Self-contained: its data is synthetic Azerbaijani-like text generated here, so a GPU machine needs
neither ../shared/data nor network access; only the repository and the packages.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from gpu_helpers import synthetic_lines


def pytest_collection_modifyitems(config, items):
    """Every test here needs CUDA, except the rehearsal checks (test_rehearsal.py), which run on CPU in the
    device's replica (scripts/gpu_rehearsal.sh) and on the GPU machine alike."""
    import torch

    here = Path(__file__).parent
    for item in items:
        path = Path(str(item.fspath))
        if here in path.parents and not path.name.startswith("test_rehearsal"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(scope="session")
def gpu_data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpudata")
    (root / "train.txt").write_text("\n".join(synthetic_lines(4000, seed=1)) + "\n", encoding="utf-8")
    (root / "valid.txt").write_text("\n".join(synthetic_lines(200, seed=2)) + "\n", encoding="utf-8")
    rng = random.Random(3)
    chats = []
    for _ in range(64):
        q, a = synthetic_lines(2, seed=rng.randint(0, 10**6))
        chats.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    (root / "chat.jsonl").write_text(
        "\n".join(json.dumps(c, ensure_ascii=False) for c in chats) + "\n", encoding="utf-8"
    )
    return {"root": root, "train": root / "train.txt", "valid": root / "valid.txt", "chat": root / "chat.jsonl"}


@pytest.fixture(scope="session")
def llama3_tokenizer_dir(tmp_path_factory) -> Path:
    from dilforge_shared.families import LLAMA3
    from dilforge_tokenizer import family_out
    from factories import llama3_bpe

    out = tmp_path_factory.mktemp("gputok") / "tokenizer"
    family_out.write_folder(llama3_bpe(synthetic_lines(3000), 512), out, LLAMA3)
    return out


@pytest.fixture(scope="session")
def chatml_llama_dir(tmp_path_factory) -> Path:
    from factories import build_tiny_llama
    from sft_factories import build_chatml_tokenizer

    root = tmp_path_factory.mktemp("gpuchatml")
    return build_tiny_llama(root / "model", build_chatml_tokenizer(root / "tokenizer", lines=synthetic_lines(3000)))


@pytest.fixture(scope="session")
def results_dir() -> Path | None:
    """Where tests write what they measured (scripts/gpu_check.sh sets DILFORGE_GPU_RESULTS)."""
    path = os.environ.get("DILFORGE_GPU_RESULTS")
    if not path:
        return None
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)
