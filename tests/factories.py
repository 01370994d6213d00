"""Small real objects for tests: a Llama-3-style tokenizer and a 2-layer, 64-dim random Llama."""

from __future__ import annotations

import itertools
import os
from pathlib import Path


def data_root() -> Path:
    root = Path(os.environ.get("DILFORGE_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    if not (root / "az").is_dir():
        raise RuntimeError(f"Azerbaijani data not found at {root}; set DILFORGE_DATA to ../shared/data")
    return root


def wiki_lines(n: int = 5000) -> list[str]:
    from dilforge_shared.corpus import iter_texts

    return list(itertools.islice(iter_texts(str(data_root() / "az/train/azwiki_sentences_cv_extractor.txt")), n))


def bpe_from_text(batches, vocab_size: int, min_frequency: int = 2, template=None):
    """tokenizers' own BPE training on text, the reference of the stage's `bpe.train_from_counts`: a byte-level BPE
    (no special tokens) with `template`'s normalizer, pre-tokenizer and decoder, else Llama 3's."""
    from dilforge_tokenizer import bpe, llama3

    tok = llama3.empty_bpe()
    if template is not None:
        tok.normalizer, tok.pre_tokenizer, tok.decoder = template.normalizer, template.pre_tokenizer, template.decoder
    tok.train_from_iterator(batches, trainer=bpe.trainer(vocab_size, min_frequency))
    return tok


def llama3_bpe(texts: list[str], vocab_size: int, min_frequency: int = 2):
    """A new byte-level BPE of `vocab_size` regular tokens + Llama 3's 256 specials (`bpe_from_text`, then the
    stage's family_out.finish)."""
    from dilforge_shared.families import LLAMA3
    from dilforge_tokenizer import family_out

    return family_out.finish(bpe_from_text(texts, vocab_size, min_frequency), LLAMA3)


def build_tokenizer(out_dir: Path, vocab_size: int = 512, num_lines: int = 5000) -> Path:
    """A Llama-3-style BPE trained on Azerbaijani Wikipedia lines, saved as an HF folder."""
    from dilforge_shared.families import LLAMA3
    from dilforge_tokenizer import family_out

    family_out.write_folder(llama3_bpe(wiki_lines(num_lines), vocab_size), out_dir, LLAMA3)
    return out_dir


def flip_byte(path: Path, offset: int) -> None:
    """Invert one byte of a file (offset taken modulo its size; negative from the end): same size, so only a
    content digest can tell."""
    raw = bytearray(path.read_bytes())
    raw[offset % len(raw)] ^= 0xFF
    path.write_bytes(bytes(raw))


def manual_nll(model, stream, window: int, stride: int) -> tuple[float, int]:
    """(summed NLL in nats, tokens scored) of a BPB token stream by hand: each scored token's -log p from a plain
    forward over exactly the window the plan gives it, in float64 (the reference the BPB tests compare with)."""
    import torch
    from dilforge_shared.bpb import window_plan

    nll, n = 0.0, 0
    with torch.no_grad():
        for b, e, s in window_plan(len(stream.ids), window, stride):
            logp = torch.log_softmax(model(torch.tensor([stream.ids[b:e]])).logits[0].double(), -1)
            for t in range(s, e):
                if stream.scored[t]:
                    nll -= logp[t - 1 - b, stream.ids[t]].item()
                    n += 1
    return nll, n


def load_bench(name: str):
    """bench/<name>.py as a module (bench/ holds scripts, not a package; their own `import hardware` resolves)."""
    import importlib.util
    import sys

    bench_dir = Path(__file__).resolve().parents[1] / "bench"
    if str(bench_dir) not in sys.path:
        sys.path.insert(0, str(bench_dir))
    spec = importlib.util.spec_from_file_location(f"{name}_bench", bench_dir / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tiny_llama_config(vocab_size: int, **overrides):
    from transformers import LlamaConfig

    kwargs = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
    }
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def build_tiny_llama(out_dir: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random 2-layer, 64-dim Llama saved as safetensors next to its tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    torch.manual_seed(seed)
    cfg = tiny_llama_config(
        len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **overrides,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    return out_dir


# A known multi-turn conversation and its hand-written SFT loss mask, shared by the unit and the
# end-to-end mask tests. Each segment is (text, is it in the loss?). Headers, system and user text
# are masked; assistant content and the <|eot_id|> that closes each assistant turn are not; the
# "\n\n" after the assistant header belongs to the header.
SFT_CONVERSATION = [
    {"role": "system", "content": "Sən köməkçisən."},
    {"role": "user", "content": "Salam!"},
    {"role": "assistant", "content": "Salam, necə kömək edim?"},
    {"role": "user", "content": "Bakı haradadır?"},
    {"role": "assistant", "content": "Bakı Azərbaycanın paytaxtıdır."},
]
SFT_EXPECTED_MASK = [
    ("<|begin_of_text|>", 0),
    ("<|start_header_id|>", 0),
    ("system", 0),
    ("<|end_header_id|>", 0),
    ("\n\nSən köməkçisən.", 0),
    ("<|eot_id|>", 0),
    ("<|start_header_id|>", 0),
    ("user", 0),
    ("<|end_header_id|>", 0),
    ("\n\nSalam!", 0),
    ("<|eot_id|>", 0),
    ("<|start_header_id|>", 0),
    ("assistant", 0),
    ("<|end_header_id|>", 0),
    ("\n\n", 0),
    ("Salam, necə kömək edim?", 1),
    ("<|eot_id|>", 1),
    ("<|start_header_id|>", 0),
    ("user", 0),
    ("<|end_header_id|>", 0),
    ("\n\nBakı haradadır?", 0),
    ("<|eot_id|>", 0),
    ("<|start_header_id|>", 0),
    ("assistant", 0),
    ("<|end_header_id|>", 0),
    ("\n\n", 0),
    ("Bakı Azərbaycanın paytaxtıdır.", 1),
    ("<|eot_id|>", 1),
]


def sft_expected_tokens(tok, segments=SFT_EXPECTED_MASK) -> tuple[list[int], list[int]]:
    """(input ids, labels) of hand-written (text, in-loss) segments: labels are the ids, or -100 off the loss."""
    ids, labels = [], []
    for text, on in segments:
        seg = tok(text, add_special_tokens=False)["input_ids"]
        ids += seg
        labels += [t if on else -100 for t in seg]
    return ids, labels


def publish_tokenizer(store: Path, tok_dir: Path, name: str = "tok") -> str:
    """A tokenizer folder published as `<store>/artifacts/tokenizer/<name>` (a stage's upstream artifact)."""
    from dilforge_shared.manifest import Manifest, current_producer
    from dilforge_shared.store import publish

    uri = f"{store}/artifacts/tokenizer/{name}"
    manifest = Manifest(
        code_version="test",
        kind="tokenizer",
        artifact_id=name,
        run_id="test",
        stage="tokenizer",
        producer=current_producer("dilforge-tokenizer"),
        config={},
        data_dir="pending",
        files=[],
    )
    publish(uri, tok_dir, manifest)
    return uri


def make_manifest(**overrides):
    """A valid manifest with made-up contents, for store and schema tests."""
    from dilforge_shared.manifest import FileEntry, InputRef, Manifest, Producer

    fields = {
        "kind": "tokenizer",
        "artifact_id": "abc123",
        "run_id": "r1",
        "stage": "tokenizer",
        "code_version": "test",
        "producer": Producer(package="dilforge-tokenizer", version="0.1.0", libraries={"tokenizers": "0.23.3"}),
        "config": {"strategy": "replace", "vocab_sizes": [1000]},
        "inputs": [InputRef(name="data:corpus", kind="data", uri="/data/a.txt", sha256="0" * 64)],
        "data_dir": "data-0123",
        "files": [FileEntry(path="tokenizer.json", size=3, sha256="a" * 64)],
        "metrics": {"fertility": 1.5},
    }
    fields.update(overrides)
    return Manifest(**fields)


def write_output(tmp_path: Path, name: str = "out", content: bytes = b"weights") -> Path:
    """A stage output folder with a nested file."""
    out = tmp_path / name
    (out / "sub").mkdir(parents=True)
    (out / "model.safetensors").write_bytes(content)
    (out / "sub" / "config.json").write_text("{}")
    return out


def job_manifest(job, kind: str, **fields):
    """The manifest a real stage publishes for a coordinator job (for fake backends): its config, code version and
    the very inputs the id was planned from, so reuse can prove the artifact is the job's."""
    from dilforge_coordinator.pipeline import stage_refs
    from dilforge_shared.identity import code_version
    from dilforge_shared.manifest import Manifest, current_producer

    return Manifest(
        kind=kind,
        artifact_id=job.artifact_id,
        run_id=job.run_id,
        stage=job.stage,
        code_version=code_version(job.stage),
        producer=current_producer("test"),
        config=job.config.model_dump(mode="json"),
        inputs=stage_refs(job.config, job.inputs, job.s3_endpoint_url),
        data_dir="pending",
        files=[],
        **fields,
    )


def clear_aws(monkeypatch, tmp_path: Path) -> Path:
    """No AWS credentials, profile, region or config file anywhere: a dry run must not need them."""
    for key in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "DILFORGE_STORE",
        "DILFORGE_VAR_SAGEMAKER_ROLE",
        "AWS_REGION",
        "DILFORGE_S3_ENDPOINT_URL",
    ):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("DILFORGE_IMAGES_RECORD", str(tmp_path / "images.json"))
    return tmp_path


def fill_what_moto_omits(backend) -> None:
    """moto's DescribeProcessingJob leaves out ProcessingResources, which SageMaker always returns (the SDK's
    waiter reads the instance count from it): filled in at botocore, from the job's request, on the session the
    backend waits through."""

    def fill(parsed, model, **kwargs):
        request = next(r for r in backend.requests if r["ProcessingJobName"] == parsed["ProcessingJobName"])
        parsed.setdefault("ProcessingResources", request["ProcessingResources"])

    backend.session().events.register("after-call.sagemaker.DescribeProcessingJob", fill)


class CheckpointTensors:
    """A checkpoint component for any module + optimizer (the stage registers optim.TrainingModel)."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, self.osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": {"state": self.osd["state"]}}

    def load_state_dict(self, saved):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.opt,
            model_state_dict=saved["model"],
            optim_state_dict={"state": saved["optim"]["state"], "param_groups": self.osd["param_groups"]},
        )


def tiny_cpt_config(**update):
    """The CPT config the loop and pipeline unit tests train with: two corpora (one at half weight), a
    validation set, 3 + 4 steps at 16 tokens, global batch 4 in micro-batches of 2."""
    from dilforge_cpt.config import CptConfig

    cfg = CptConfig(
        scratch_model={},
        corpora=[{"uri": "a"}, {"uri": "b", "weight": 0.5}],
        validation=[{"uri": "v"}],
        seq_len=16,
        global_batch_size=4,
        micro_batch_size=2,
        phase1={"num_steps": 3, "learning_rate": 0.01},
        phase2={"num_steps": 4, "learning_rate": 0.003, "num_warmup_steps": 1},
        log_every=1,
        eval_every=100,
        checkpoint_every=100,
        precision="fp32",  # the same arithmetic on every CPU (auto is bf16 where the CPU has bf16 instructions)
    )
    return cfg.model_copy(update=update)


# A CPT stage section for one step per phase on a 2-layer scratch model (the oversized-input test and its bench
# add the corpora under test).
# The 2-layer scratch Llama the CPT stage tests train (`scratch_model` of a CPT section).
TINY_SCRATCH = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TINY_CPT_SECTION = {
    "scratch_model": TINY_SCRATCH,
    "seq_len": 64,
    "global_batch_size": 4,
    "micro_batch_size": 2,
    "phase1": {"num_steps": 1, "learning_rate": 0.01},
    "phase2": {"num_steps": 1, "learning_rate": 0.003, "num_warmup_steps": 0},
    "validation": [{"uri": "${DILFORGE_DATA}/az/dev/flores200.dev.partial_from_sib200.tsv", "text_field": "azj_Latn"}],
    "num_validation_docs": 8,
}
