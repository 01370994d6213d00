"""What the SFT stage publishes besides its metrics: the PEFT adapter, the merged model, the label preview (which
tokens the loss falls on) and the loss curve."""

from __future__ import annotations

import json
from pathlib import Path

from dilforge_shared.families import GENERATION_CONFIG_FILE
from dilforge_shared.specials import describe_model_folder, merge_adapter

from .config import GenerationDefaults


def save_adapter(trainer, tokenizer, out_dir: Path, base_uri: str) -> None:
    """PEFT adapter (safetensors) + tokenizer; adapter_config names the base by its URI, not a local path."""
    trainer.model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    cfg_path = out_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = base_uri
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    describe_model_folder(out_dir)


def save_merged(base_dir: Path, adapter_dir: Path, out_dir: Path) -> None:
    """The merged model (`specials.merge_adapter`) with the adapter's tokenizer, describing its family."""
    from transformers import AutoTokenizer

    merge_adapter(base_dir, adapter_dir, out_dir)
    AutoTokenizer.from_pretrained(str(adapter_dir), trust_remote_code=False).save_pretrained(str(out_dir))
    describe_model_folder(out_dir)


def write_generation_defaults(folder: Path, generation: GenerationDefaults) -> None:
    """Add the decoding defaults set (repetition control) to the folder's generation_config.json, other keys kept:
    what every stock consumer (transformers generate and serve, the GGUF export) then applies by itself."""
    defaults = generation.model_dump(exclude_none=True)
    if not defaults:
        return
    path = folder / GENERATION_CONFIG_FILE
    gen = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    gen.update(defaults)
    path.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_label_preview(dataset, tokenizer, path: Path, num_examples: int) -> int:
    """The first training rows as the trainer sees them, one JSON line each with the ids, a 0/1 `trained` flag per
    token and both decoded: which tokens the loss falls on. Returns the rows written."""
    n = min(num_examples, len(dataset))
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            ids = list(dataset[i]["input_ids"])
            trained = [0 if label == -100 else 1 for label in dataset[i]["labels"]]
            trained_ids = [t for t, on in zip(ids, trained, strict=False) if on]
            row = {"index": i, "input_ids": ids, "trained": trained, "text": tokenizer.decode(ids)}
            row["trained_text"] = tokenizer.decode(trained_ids)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return n
