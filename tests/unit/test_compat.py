"""dilforge_shared.compat, the one door to library internals: each of its functions exercised on real inputs
(so a torch/transformers/trl upgrade that changes one fails here, naming it), the installed versions inside the
ranges it was checked against, and a scan of the production tree that fails on any import of a non-public
module or underscore name of torch, transformers, trl, peft, liger-kernel or datasets outside compat.
The store's private parts are not used outside dilforge_shared.store either (a second scan).
"""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import pytest
import torch
from dilforge_shared import compat
from dilforge_shared.compat import dcp as compat_dcp
from dilforge_shared.compat import gguf as compat_gguf
from dilforge_shared.compat import serve as compat_serve


def test_dcp_reader_loads_a_real_checkpoint_and_refuses_a_hostile_pickle(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"))
    target = {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}}
    reader = compat_dcp.safe_dcp_reader(tmp_path / "ck")
    assert reader.read_metadata().storage_meta.load_id == reader.load_id
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["model"]["w"], state["model"]["w"]) and torch.equal(target["model"]["b"], torch.ones(3))

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="builtins.print, which is not allowed"):
        compat_dcp.safe_dcp_reader(tmp_path / "ck").read_metadata()


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


def test_gguf_reads_metadata_tensors_and_the_tokenizer(tmp_path):
    path = tiny_llama_gguf(tmp_path / "tiny.gguf")
    meta = compat_gguf.gguf_metadata(path)
    assert meta["general.architecture"] == "llama" and meta["llama.embedding_length"] == 4
    head = compat_gguf.gguf_header(path)
    (info,) = head.tensors
    assert info.name == "token_embd.weight" and sorted(int(d) for d in info.shape) == [4, 6]
    assert head.data_start + info.offset + info.nbytes <= path.stat().st_size
    compat_gguf.save_gguf_tokenizer(compat_gguf.gguf_tokenizer(path), tmp_path / "tok")
    doc = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    assert doc["model"]["type"] == "BPE" and doc["model"]["vocab"]["ab"] == 4
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json")).encode("ab").ids[-1] == 4


def store_private_uses(name: str, source: str) -> list[str]:
    """`from ...store import _x` or `store._x` in one module: what would break silently when the store changes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "store":
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
    store = root / "shared" / "dilforge_shared" / "store.py"
    packages = [root / "shared" / "dilforge_shared", root / "coordinator" / "dilforge_coordinator"]
    packages += sorted((root / "services").glob("*/dilforge_*"))
    found = [
        use
        for package in packages
        for path in sorted(package.rglob("*.py"))
        if path != store
        for use in store_private_uses(path.relative_to(root).as_posix(), path.read_text())
    ]
    assert found == []
    assert store_private_uses("m.py", "from .store import NotFound, _artifact_backend") == [
        "m.py: imports _artifact_backend"
    ]
    assert store_private_uses("m.py", "from dilforge_shared import store\nstore._cache(1)") == [
        "m.py: uses store._cache"
    ]


LIBRARIES = ("torch", "transformers", "trl", "peft", "liger_kernel", "datasets")
# modules of those libraries that are public API (their documented import paths); anything else is internal
PUBLIC_MODULES = {
    "torch",
    "torch.nn",
    "torch.nn.functional",
    "torch.nn.attention",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.utils.data",
    "torch.utils.tensorboard",
    "torch.profiler",
    "torch.optim",
    "transformers",
    "transformers.integrations",
    "transformers.trainer_utils",  # get_last_checkpoint, as HF's example scripts import it
    "trl",
    "peft",
    "datasets",
    "liger_kernel.transformers",
}


def internal_uses(name: str, source: str) -> list[str]:
    """Imports of non-public modules or underscore names of LIBRARIES, and `lib._name` attribute uses."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [(node.module, [a.name for a in node.names])]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in LIBRARIES:
                found.append(f"{name}:{node.lineno}: {root.id}...{node.attr}")
            continue
        else:
            continue
        for module, names in modules:
            if module.split(".")[0] not in LIBRARIES:
                continue
            if module not in PUBLIC_MODULES:
                found.append(f"{name}:{node.lineno}: imports {module}")
            found += [f"{name}:{node.lineno}: imports {module}.{n}" for n in names if n.startswith("_")]
    return found


def production_files(root: Path) -> list[Path]:
    packages = [root / "shared", root / "coordinator", root / "docker"] + sorted((root / "services").glob("*/"))
    return [p for package in packages for p in sorted(package.rglob("*.py")) if ".egg-info" not in str(p)]


def test_no_library_internals_outside_compat():
    root = Path(__file__).resolve().parents[2]
    door = root / "shared" / "dilforge_shared" / "compat"
    found = [
        use
        for path in production_files(root)
        if path.parent != door
        for use in internal_uses(path.relative_to(root).as_posix(), path.read_text())
    ]
    assert found == []
    for module in ("dcp", "gguf", "serve"):  # the scan does see them, in each door
        assert internal_uses(module, (door / f"{module}.py").read_text()), module
    assert internal_uses("m.py", "from transformers.models.llama import modeling_llama") == [
        "m.py:1: imports transformers.models.llama"
    ]
    assert internal_uses("m.py", "import torch\ntorch._dynamo.reset()") == ["m.py:2: torch..._dynamo"]
    assert internal_uses("m.py", "from torch.nn import _reduction") == ["m.py:1: imports torch.nn._reduction"]
    assert internal_uses("m.py", "from transformers import AutoModelForCausalLM\nimport numpy._core") == []


def test_installed_libraries_are_within_the_checked_ranges():
    assert compat.warn_unchecked_versions() == {}


def test_a_version_that_is_not_pep_440_is_warned_of_not_raised(monkeypatch):
    monkeypatch.setattr(compat, "version", lambda name: "2.x-local" if name == "pydantic" else "0")
    monkeypatch.setattr(compat, "CHECKED", {"pydantic": ("2.0.0", "2.99.0")})
    assert compat.warn_unchecked_versions() == {"pydantic": "2.x-local"}


def test_the_first_use_of_an_internal_warns_once_of_a_library_outside_the_checked_versions(monkeypatch, caplog):
    """A stage that uses no internal (curate, tokenizer, eval) neither loads this module nor warns."""
    monkeypatch.setitem(compat.CHECKED, "pydantic", ("1.0.0", "1.10.0"))  # installed: 2.x
    compat.first_use.cache_clear()
    with caplog.at_level("WARNING", logger="dilforge"):
        compat.first_use()
        compat.first_use()
    compat.first_use.cache_clear()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and warned[0].startswith("pydantic 2.") and warned[0].endswith("(1.0.0 to 1.10.0)")


def test_serve_command_app_is_transformers_serve_built_but_not_started(monkeypatch):
    """The app is the one the `transformers serve` command builds (its routes), with the model pinned, and no server
    thread was started (the caller's uvicorn runs it)."""
    import threading

    from transformers.cli.serving import model_manager

    loaded = []
    monkeypatch.setattr(model_manager.ModelManager, "load_model_and_processor", lambda self, *a, **k: loaded.append(a))
    before = threading.active_count()
    app = compat_serve.serve_command_app("some-folder", device="cpu", dtype="auto")
    paths = {route.path for route in app.routes}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= paths
    assert loaded and threading.active_count() == before
