"""Model import verifies weights before publishing (issue 23 item 6): shapes match the config, safetensors headers
match the file, tensors load; a truncated GGUF is a one-line error naming the file and tensor."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from dilforge_shared.errors import InputError

pytest.importorskip("dilforge_cpt")
from dilforge_cpt.gguf_convert import convert_gguf
from dilforge_cpt.import_model import read_license
from dilforge_cpt.weights_check import read_header, verify_weights


@pytest.fixture
def folder(tmp_path, tiny_llama_dir) -> Path:
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * ((8 - len(new) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + length :])


def test_the_tiny_llama_passes(folder):
    verify_weights(folder)


def test_weights_of_another_shape_than_the_config_are_refused(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        InputError,
        match=r"model.safetensors: tensor 'model.layers.0.mlp.down_proj.weight' has shape "
        r"\[64, 128\], config.json gives \[64, 96\] \(and 5 more\)",
    ):
        verify_weights(folder)


def test_a_header_declaring_a_huge_tensor_is_refused_without_allocating(folder):
    def huge(header):
        header["model.embed_tokens.weight"]["shape"] = [10**9, 10**9]

    _rewrite_header(folder / "model.safetensors", huge)
    with pytest.raises(
        InputError, match=r"model.safetensors: not a valid safetensors file: .*overflow computing buffer"
    ):
        verify_weights(folder)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda raw: raw[:-100], "file not fully covered \\(truncated, or bytes after the last tensor\\)"),
        (lambda raw: struct.pack("<Q", 1 << 40) + raw[8:], "header too large"),
        (lambda raw: raw[:5], "header too small"),
        (lambda raw: raw[:8] + b"\xff" + raw[9:], "invalid UTF-8 in header"),
        (lambda raw: raw + b"\0" * 16, "file not fully covered"),
    ],
)
def test_a_damaged_safetensors_file_is_one_line_naming_it(folder, damage, message):
    path = folder / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(InputError, match=message) as info:
        read_header(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_two_tensors_over_the_same_bytes_are_refused(folder):
    _rewrite_header(folder / "model.safetensors", lambda h: h.update({"extra.weight": {**h["model.norm.weight"]}}))
    # safetensors reports one of the two (its header is a hash map: which one is not fixed from run to run)
    with pytest.raises(InputError, match="invalid offset for tensor `(extra|model.norm).weight`"):
        verify_weights(folder)


def test_the_header_gives_every_tensor_dtype_and_shape(folder):
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    assert read_header(folder / "model.safetensors") == {
        name: {"dtype": "F32", "shape": list(t.shape)} for name, t in tensors.items()
    }


def test_the_license_comes_from_the_model_card_front_matter(tmp_path, caplog):
    card = tmp_path / "README.md"
    assert read_license(tmp_path) is None  # no card
    card.write_text("---\nlanguage: [az, en]\nlicense: apache-2.0\ntags: [llama]\n---\n# Model\nlicense: mit\n")
    assert read_license(tmp_path) == "apache-2.0"
    card.write_text("# Model\n\nlicense: mit (in the prose, not the front matter)\n")
    assert read_license(tmp_path) is None
    card.write_text("---\nlicense: [unclosed\n---\n")
    assert read_license(tmp_path) is None and "front matter does not parse" in caplog.text


def test_a_missing_tensor_is_named(folder):
    _rewrite_header(folder / "model.safetensors", lambda h: h.update({"model.nrm.weight": h.pop("model.norm.weight")}))
    with pytest.raises(InputError, match=r"lack 1 tensor\(s\) config.json needs, e.g. \['model.norm.weight'\]"):
        verify_weights(folder)


def _llama_gguf(path: Path, blocks: int = 1, heads: int = 1) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(blocks)
    writer.add_head_count(heads)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_context_length(128)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(16)])
    writer.add_tensor("token_embd.weight", np.ones((16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_truncated_gguf_is_one_line_naming_the_file_and_tensor(tmp_path):
    path = _llama_gguf(tmp_path / "tiny.gguf")
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(InputError, match=r"tiny.gguf: truncated GGUF: tensor token_embd.weight needs bytes up to"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"num_hidden_layers": 100_000}, r"imply at least [\d,]+ parameters; the weights hold [\d,]+"),
        ({"hidden_size": -64}, r"hidden_size must be a positive integer \(got -64\)"),
        ({"num_attention_heads": 0}, r"num_attention_heads must be a positive integer \(got 0\)"),
        ({"num_attention_heads": "4"}, r"num_attention_heads must be a positive integer \(got '4'\)"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, r"not a multiple of num_key_value_heads \(3\)"),
    ],
)
def test_absurd_or_inconsistent_sizes_are_refused_before_anything_is_built(folder, edit, message, monkeypatch):
    import dilforge_cpt.weights_check as wc

    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **edit}))
    # building the architecture (100,000 layers on the meta device took minutes and gigabytes) never starts
    monkeypatch.setattr(wc, "expected_shapes", lambda folder: pytest.fail("a model was built"))
    with pytest.raises(InputError, match=message):
        verify_weights(folder)


def test_a_tokenizer_with_more_ids_than_embedding_rows_is_refused(folder):
    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": cfg["vocab_size"] + 5000, "content": "<|extra|>"})
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(InputError, match=rf"ids up to {cfg['vocab_size'] + 5000}, the model's embedding"):
        verify_weights(folder)


@pytest.mark.parametrize(
    ("blocks", "heads", "message"),
    [
        (1_000_000, 1, r"1000000 layers, hidden 32, .* imply at least [\d,]+ parameters; the weights hold 512"),
        (1, 0, r"num_attention_heads must be a positive integer \(got 0\)"),
    ],
)
def test_a_gguf_claiming_absurd_sizes_is_refused_before_a_model_is_built(tmp_path, blocks, heads, message):
    path = _llama_gguf(tmp_path / "big.gguf", blocks=blocks, heads=heads)
    with pytest.raises(InputError, match=message):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _gguf_with_tokenizer(path: Path, model: str | None, merges=None, scores: bool = True) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    for add, value in (("block_count", 1), ("head_count", 1), ("embedding_length", 32), ("feed_forward_length", 64)):
        getattr(writer, f"add_{add}")(value)
    writer.add_context_length(128)
    writer.add_layer_norm_rms_eps(1e-5)
    tokens = ["a", "b", "ab", "<|begin_of_text|>", "<|end_of_text|>"]
    if model is not None:
        writer.add_tokenizer_model(model)
        writer.add_token_list(tokens)
        writer.add_token_types([1] * len(tokens))
    if merges is not None:
        writer.add_token_merges(merges)
    if model == "llama" and scores:
        writer.add_token_scores([0.0] * len(tokens))
    writer.add_tensor("token_embd.weight", np.ones((len(tokens), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("model", "merges", "scores", "message"),
    [
        ("gpt2", ["a zz"], True, r"tokenizer\.ggml\.merges\[0\] is 'a zz': not two tokens of tokenizer\.ggml\.tokens"),
        ("gpt2", ["a b", "ab"], True, r"tokenizer\.ggml\.merges\[1\] is 'ab'"),
        ("llama", None, False, r"tokenizer\.ggml\.scores has None entries for 5 tokens"),
        (None, None, True, r"tokenizer\.ggml\.model is None; dilforge imports gpt2 \(byte-level BPE\)"),
    ],
)
def test_a_gguf_tokenizer_that_cannot_be_built_is_one_line_before_tensors_are_read(
    tmp_path, model, merges, scores, message, monkeypatch
):
    import dilforge_cpt.gguf_convert as gc

    path = _gguf_with_tokenizer(tmp_path / "t.gguf", model, merges, scores)
    monkeypatch.setattr(gc, "dequantized_tensors", lambda path: pytest.fail("tensors were read"))
    with pytest.raises(InputError, match=message):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_well_formed_gguf_tokenizer_passes_the_check(tmp_path):
    from dilforge_cpt.gguf_convert import gguf_metadata, read_gguf_tokenizer

    path = _gguf_with_tokenizer(tmp_path / "t.gguf", "gpt2", ["a b"])
    _, tokenizer, _ = read_gguf_tokenizer(path, gguf_metadata(path))
    assert tokenizer["tokens"][:3] == ["a", "b", "ab"] and tokenizer["merges"] == ["a b"]
