"""The folder the server is pinned to: the artifact's weights (linked, never copied or modified), its tokenizer,
and a serving chat template that makes the SFT system prompt the default system message.

transformers serve loads a model by name from the hub or a local path; dilforge pins it to this folder,
named by the model id (`az-small-sft`), with the server's working directory its parent, so the OpenAI
`model` field a client sends is that id and nothing else. An adapter is merged into its base here (PEFT
`merge_and_unload`, fp32 on CPU, saved in the base's dtype): every server then runs one plain model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from dilforge_shared.families import CHAT_TEMPLATE_FILE, describe_model_folder
from dilforge_shared.serving import ServedModel, chat_template_of, serving_template

log = logging.getLogger("dilforge.serve")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", CHAT_TEMPLATE_FILE)
WEIGHT_SUFFIXES = (".safetensors",)


def merge_adapter(base_dir: Path, adapter_dir: Path, out: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, trust_remote_code=False)
    dtype = getattr(base.config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.to(dtype).save_pretrained(str(out), safe_serialization=True)


def link_model_files(src: Path, out: Path) -> None:
    """Weights as symlinks (nothing is copied or ever written through); small JSON files as copies."""
    for path in sorted(src.iterdir()):
        if not path.is_file() or path.name in TOKENIZER_FILES:
            continue
        if path.name.endswith(WEIGHT_SUFFIXES):
            os.symlink(path.resolve(), out / path.name)
        elif path.suffix == ".json":
            shutil.copyfile(path, out / path.name)


def prepare(spec: ServedModel, root: Path) -> Path:
    """Build `root/<model id>/` for `spec`; returns it. Rebuilt on every start (cheap: links and JSON)."""
    out = root / spec.model_id
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if spec.adapter_dir is not None:
        log.info("merging adapter %s into %s", spec.adapter_dir, spec.base_dir)
        merge_adapter(spec.base_dir, spec.adapter_dir, out)
    else:
        link_model_files(spec.base_dir, out)
    for name in TOKENIZER_FILES:
        if (spec.tokenizer_dir / name).is_file():
            shutil.copyfile(spec.tokenizer_dir / name, out / name)
    template = chat_template_of(out)
    tok_config_path = out / "tokenizer_config.json"
    if tok_config_path.is_file():  # one template only: the .jinja file below
        tok_config = json.loads(tok_config_path.read_text(encoding="utf-8"))
        if tok_config.pop("chat_template", None) is not None:
            tok_config_path.write_text(json.dumps(tok_config, indent=2), encoding="utf-8")
    family, ids = describe_model_folder(out)  # also for models published before they carried their stops
    template = template or chat_template_of(out) or family.chat_template
    (out / CHAT_TEMPLATE_FILE).write_text(serving_template(template, spec.system_prompt), encoding="utf-8")
    log.info(
        "serving %s as %r from %s (%s family, stops %s, default system message: %s)",
        spec.description,
        spec.model_id,
        out,
        family.name,
        ids["eos_token_id"],
        "yes" if spec.system_prompt else "none",
    )
    return out
