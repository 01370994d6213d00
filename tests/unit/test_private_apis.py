"""Every private API the project relies on sits behind one adapter module, exercised here on real inputs, so a
torch or transformers upgrade that changes one fails in this file, naming the adapter (issue 22 item 4):

- dilforge_cpt.dcp_reader: a torch.distributed.checkpoint FileSystemReader subclass (its private
  `_get_metadata_path`, the metadata's `storage_meta.load_id`);
- dilforge_cpt.gguf_compat: transformers.integrations.gguf (reader.read_gguf_metadata, reader.GgufHeader,
  gguf_tokenizer_mapping.get_gguf_tokenizer / convert_gguf_tokenizer).
The store's private parts are not used outside dilforge_shared.store (integrity checks open an artifact's
folder with the public `artifact_storage`; identity.model_digest reads the public listing): a scan below.
"""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import pytest
import torch
from dilforge_cpt import dcp_reader, gguf_compat


def test_dcp_reader_loads_a_real_checkpoint_and_refuses_a_hostile_pickle(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"))
    target = {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}}
    reader = dcp_reader.safe_reader(tmp_path / "ck")
    assert reader.read_metadata().storage_meta.load_id == reader.load_id
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["model"]["w"], state["model"]["w"]) and torch.equal(target["model"]["b"], torch.ones(3))

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="builtins.print, which is not allowed"):
        dcp_reader.safe_reader(tmp_path / "ck").read_metadata()


def tiny_llama_gguf(path: Path) -> Path:
    """A one-layer llama GGUF with a byte-level BPE tokenizer (gpt2 model) in its metadata."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_head_count(1)
    writer.add_embedding_length(4)
    writer.add_feed_forward_length(8)
    writer.add_context_length(16)
    writer.add_layer_norm_rms_eps(1e-5)
    tokens = ["<|begin_of_text|>", "<|end_of_text|>", "a", "b", "ab", "Ġ"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 1, 1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_tensor("token_embd.weight", np.ones((len(tokens), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_compat_reads_metadata_tensors_and_the_tokenizer(tmp_path):
    path = tiny_llama_gguf(tmp_path / "tiny.gguf")
    meta = gguf_compat.read_metadata(path)
    assert meta["general.architecture"] == "llama" and meta["llama.embedding_length"] == 4
    head = gguf_compat.header(path)
    (info,) = head.tensors
    assert info.name == "token_embd.weight" and sorted(int(d) for d in info.shape) == [4, 6]
    assert head.data_start + info.offset + info.nbytes <= path.stat().st_size
    gguf_compat.save_tokenizer(path, tmp_path / "tok")
    doc = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    assert doc["model"]["type"] == "BPE" and doc["model"]["vocab"]["ab"] == 4
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json")).encode("ab").ids[-1] == 4


def store_private_uses(name: str, source: str) -> list[str]:
    """`from ...store import _x` or `store._x` in one module: what would break silently when the store changes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] in (
            "store",
            "artifacts",
            "backends",
        ):
            found += [f"{name}: imports {a.name}" for a in node.names if a.name.startswith("_")]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "store"
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{name}: uses store.{node.attr}")
    return found


def test_nothing_outside_the_store_uses_its_private_names():
    root = Path(__file__).resolve().parents[2]
    store = root / "shared" / "dilforge_shared" / "store"
    packages = [root / "shared" / "dilforge_shared", root / "coordinator" / "dilforge_coordinator"]
    packages += sorted((root / "services").glob("*/dilforge_*"))
    found = [
        use
        for package in packages
        for path in sorted(package.rglob("*.py"))
        if store not in path.parents
        for use in store_private_uses(path.relative_to(root).as_posix(), path.read_text())
    ]
    assert found == []
    assert store_private_uses("m.py", "from .store import NotFound, _artifact_backend") == [
        "m.py: imports _artifact_backend"
    ]
    assert store_private_uses("m.py", "from dilforge_shared import store\nstore._cache(1)") == [
        "m.py: uses store._cache"
    ]
