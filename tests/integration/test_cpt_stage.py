"""CPT stage end to end through the coordinator (local backend) on a 2-layer, 64-dim Llama.

Tolerance for the 1- vs 2-process comparison: the same global batch is split differently (gradient
accumulation of 2 micro-batches in one process vs. one micro-batch per process with FSDP2's
reduce-scatter average), so only float summation order differs; losses agree to 1e-4 relative.
The interrupted run resumes from a full checkpoint (model, optimizer, data position, RNG) on the
same machine and must reproduce the uninterrupted run's final loss to 1e-6 relative.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import factories
import psutil
import pytest
import yaml
from dilforge_coordinator.integrity import recompute_artifact_id

pytestmark = pytest.mark.slow

COORDINATOR = str(Path(sys.executable).parent / "coordinator")
WIKI = "${DILFORGE_DATA}/az/train/azwiki_sentences_cv_extractor.txt"
FLORES = "${DILFORGE_DATA}/az/dev/flores200.dev.partial_from_sib200.tsv"
SCRATCH = factories.TINY_SCRATCH


def cpt_section(**overrides) -> dict:
    section = {
        "scratch_model": SCRATCH,
        "corpora": [{"uri": WIKI, "max_docs": 2000}],
        "validation": [{"uri": FLORES, "text_field": "azj_Latn"}],
        "num_validation_docs": 40,
        "seq_len": 64,
        "global_batch_size": 4,
        "micro_batch_size": 2,
        "phase1": {"num_steps": 3, "learning_rate": 0.01},
        "phase2": {"num_steps": 17, "learning_rate": 0.003, "num_warmup_steps": 2},
        "log_every": 1,
        "eval_every": 10,
        "checkpoint_every": 10,
        # fp32 on every CPU: auto would autocast to bf16 where the CPU has bf16 instructions, and these runs are
        # compared with goldens and with FSDP runs across machines
        "precision": "fp32",
    }
    section.update(overrides)
    return section


def write_pipeline(path: Path, store: Path, cpt: dict, run_id: str = "t") -> Path:
    path.write_text(yaml.safe_dump({"run_id": run_id, "store": {"uri": str(store)}, "cpt": cpt}))
    return path


def coordinator_cmd(config: Path, data_root: Path, tokenizer_uri: str) -> list[str]:
    return [
        COORDINATOR,
        "run",
        "cpt",
        "--config",
        str(config),
        "--data",
        str(data_root),
        "--input",
        f"tokenizer={tokenizer_uri}",
    ]


def env_for(workdir: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "DILFORGE_WORKDIR": str(workdir), "PYTHONWARNINGS": "ignore"}


def run_cpt(tmp: Path, data_root: Path, tok_dir: Path, cpt: dict, check: bool = True) -> subprocess.CompletedProcess:
    store = tmp / "store"
    tok_uri = factories.publish_tokenizer(store, tok_dir)
    config = write_pipeline(tmp / "pipeline.yaml", store, cpt)
    proc = subprocess.run(
        coordinator_cmd(config, data_root, tok_uri),
        env=env_for(tmp / "work"),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def published(store: Path) -> list[Path]:
    return (
        sorted((store / "artifacts" / "cpt").glob("*/manifest.json")) if (store / "artifacts" / "cpt").exists() else []
    )


def artifact(store: Path):
    from dilforge_shared.store import fetch

    (manifest_path,) = published(store)
    return fetch(str(manifest_path.parent))


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, data_root, tiny_tokenizer_dir):
    tmp = tmp_path_factory.mktemp("cpt1")
    run_cpt(tmp, data_root, tiny_tokenizer_dir, cpt_section())
    return artifact(tmp / "store")


def test_trains_publishes_loadable_model(single_run, tiny_tokenizer_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    art = single_run
    m = art.manifest
    assert m.kind == "model" and m.stage == "cpt"
    names = {ref.name for ref in m.inputs}
    assert {
        "tokenizer",
        "data:azwiki_sentences_cv_extractor.txt",
        "data:flores200.dev.partial_from_sib200.tsv",
    } <= names
    history = m.metrics["history"]
    assert [h["step"] for h in history] == list(range(1, 21))
    first, last = history[0]["loss"], m.metrics["final_train_loss"]
    assert last < first - 0.3, (first, last)
    assert m.metrics["final_val_bpb"] < m.metrics["step0_val_bpb"]
    assert {"loss", "lr", "tokens_per_s", "mfu", "peak_memory_gb"} <= set(history[-1])
    assert m.metrics["global_batch_tokens"] == 4 * 64
    model = AutoModelForCausalLM.from_pretrained(str(art.path), trust_remote_code=False)
    tok = AutoTokenizer.from_pretrained(str(art.path), trust_remote_code=False)
    assert model.config.vocab_size == len(tok) == 768
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    ids = tok("Bakı Azərbaycanın paytaxtıdır.", return_tensors="pt").input_ids
    assert torch.isfinite(model(input_ids=ids).logits).all()
    # Llama 3 family described for stock consumers: eos = <|eot_id|>, <|eom_id|>, <|end_of_text|>
    from generation_checks import assert_stock_generate_stops_at_end_of_turn, expected_ids, published_ids

    assert published_ids(art.path) == expected_ids(tok) and len(expected_ids(tok)["eos_token_id"]) == 3
    assert model.config.eos_token_id == expected_ids(tok)["eos_token_id"]
    assert_stock_generate_stops_at_end_of_turn(model.eval(), tok)


def test_bf16_autocast_on_cpu_trains_and_publishes_fp32_weights(tmp_path, data_root, tiny_tokenizer_dir):
    """bf16 on CPU (what auto chooses where the CPU has bf16 instructions) is autocast over fp32 weights: it trains,
    the manifest says bfloat16, and the published weights stay fp32 (save_dtype auto on CPU)."""
    from safetensors import safe_open

    run_cpt(
        tmp_path,
        data_root,
        tiny_tokenizer_dir,
        cpt_section(precision="bf16", phase2={"num_steps": 5, "learning_rate": 0.003}),
    )
    art = artifact(tmp_path / "store")
    m = art.manifest.metrics
    assert m["dtype"] == "bfloat16"
    losses = [h["loss"] for h in m["history"]]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    with safe_open(str(art.path / "model.safetensors"), "pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        assert {str(f.get_slice(k).get_dtype()) for k in names} == {"F32"}


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, data_root, tiny_tokenizer_dir):
    tmp = tmp_path_factory.mktemp("cpt2")
    run_cpt(tmp, data_root, tiny_tokenizer_dir, cpt_section(num_processes_per_node=2))
    return artifact(tmp / "store")


def test_two_process_fsdp_matches_single_process(single_run, two_process_run):
    m2 = two_process_run.manifest.metrics
    m1 = single_run.manifest.metrics
    assert m2["world_size"] == 2 and m1["world_size"] == 1
    l1 = [h["loss"] for h in m1["history"]]
    l2 = [h["loss"] for h in m2["history"]]
    assert l2 == pytest.approx(l1, rel=1e-4)
    assert m2["final_val_bpb"] == pytest.approx(m1["final_val_bpb"], rel=1e-4)


def sigterm_then_rerun(
    tmp_path: Path, data_root: Path, tok_dir: Path, cpt: dict, rerun_with: dict | None = None
) -> tuple[str, int, dict]:
    """Start the stage, SIGTERM the `train` process after step 2, rerun (with the `rerun_with` config changes);
    (log, stopped at, metrics)."""
    store = tmp_path / "store"
    tok_uri = factories.publish_tokenizer(store, tok_dir)
    config = write_pipeline(tmp_path / "pipeline.yaml", store, cpt)
    cmd, env = coordinator_cmd(config, data_root, tok_uri), env_for(tmp_path / "work")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if " step=2 phase=1 " in line:
            (stage,) = psutil.Process(proc.pid).children()
            stage.send_signal(signal.SIGTERM)
            break
    lines += proc.stdout.readlines()
    assert proc.wait(timeout=300) != 0, "".join(lines)[-3000:]
    text = "".join(lines)
    assert "SIGTERM" in text and "checkpoint saved" in text
    assert not published(store)
    ckpts = list((tmp_path / "work").glob("cpt-*/checkpoints/train/step-*/COMPLETE.node00000-of-00001"))
    assert ckpts, text[-3000:]
    stopped_at = json.loads(ckpts[0].read_text())["step"]
    assert 2 <= stopped_at < 20

    if rerun_with:
        write_pipeline(config, store, {**cpt, **rerun_with})
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-3000:]
    assert "resumed from checkpoint" in resumed.stdout + resumed.stderr
    interrupted_id = ckpts[0].relative_to(tmp_path / "work").parts[0].removeprefix("cpt-")
    assert artifact(store).manifest.artifact_id == interrupted_id  # the same artifact, resumed
    m = artifact(store).manifest.metrics
    assert [h["step"] for h in m["history"]] == list(range(1, 21))
    return text, stopped_at, m


def test_sigterm_then_rerun_resumes_to_the_same_loss(single_run, tmp_path, data_root, tiny_tokenizer_dir):
    """The rerun changes run-only fields (checkpoint cadence, port, tokenizer batch, a display name, a kernel
    switch): the artifact id stays, so it resumes the interrupted run's checkpoint instead of starting over."""
    section = cpt_section()
    renamed = [{**section["corpora"][0], "name": "wiki"}]
    _, _, m = sigterm_then_rerun(
        tmp_path,
        data_root,
        tiny_tokenizer_dir,
        section,
        rerun_with={
            "checkpoint_every": 7,
            "master_port": 29777,
            "tokenize_batch_size": 64,
            "corpora": renamed,
            "liger": "off",
            "num_checkpoints_kept": 3,
        },
    )
    ref = single_run.manifest.metrics
    assert m["final_train_loss"] == pytest.approx(ref["final_train_loss"], rel=1e-6)
    assert m["final_val_bpb"] == pytest.approx(ref["final_val_bpb"], rel=1e-6)


def test_two_process_sigterm_checkpoints_through_the_stop_file_then_resumes(
    two_process_run, tmp_path, data_root, tiny_tokenizer_dir
):
    """SIGTERM goes to the launcher only; workers see the stop file, checkpoint and exit (torchrun is not
    signalled, so its 30 s kill does not apply); the rerun matches the uninterrupted 2-process run."""
    text, stopped_at, m = sigterm_then_rerun(
        tmp_path, data_root, tiny_tokenizer_dir, cpt_section(num_processes_per_node=2)
    )
    assert "asked the workers to checkpoint and exit" in text
    assert f"stopped by SIGTERM at step {stopped_at}" in text
    assert "sending SIGTERM to torchrun" not in text
    assert "ChildFailedError" not in text and "Traceback" not in text  # one clean line, no torchrun noise
    assert not list((tmp_path / "work").glob("cpt-*/output/cpt-stop"))
    ref = two_process_run.manifest.metrics
    assert m["world_size"] == 2
    assert m["final_train_loss"] == pytest.approx(ref["final_train_loss"], rel=1e-6)
    assert m["final_val_bpb"] == pytest.approx(ref["final_val_bpb"], rel=1e-6)


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory, data_root) -> Path:
    return factories.build_tokenizer(tmp_path_factory.mktemp("tok600") / "tokenizer", vocab_size=600, num_lines=3000)


def test_phase1_with_transplant_keeps_backbone_bit_identical(tmp_path, data_root, tiny_llama_dir, other_tokenizer_dir):
    import torch
    from safetensors.torch import load_file

    cpt = cpt_section(
        scratch_model=None,
        base_model=str(tiny_llama_dir),
        transplant="mean_of_pieces",
        phase1={"num_steps": 3, "learning_rate": 0.01},
        phase2={"num_steps": 0},
    )
    run_cpt(tmp_path, data_root, other_tokenizer_dir, cpt)
    art = artifact(tmp_path / "store")
    before = load_file(str(tiny_llama_dir / "model.safetensors"))
    after = load_file(str(art.path / "model.safetensors"))
    backbone = [k for k in before if "embed_tokens" not in k and "lm_head" not in k]
    assert backbone and all(torch.equal(before[k], after[k]) for k in backbone)
    assert after["model.embed_tokens.weight"].shape[0] == 600 + 256
    report = art.manifest.metrics["transplant"]
    assert report["method"] == "mean_of_pieces" and report["num_kept"] > 256
    assert list(report["step0_val_bpb"]) == ["mean_of_pieces"]  # only the trained initialisation is scored
    assert math.isfinite(report["step0_val_bpb"]["mean_of_pieces"])
    assert any(ref.name == f"model:{tiny_llama_dir}" for ref in art.manifest.inputs)
    assert recompute_artifact_id(art.manifest) == art.manifest.artifact_id


def test_kept_rows_learning_rate_under_two_process_fsdp(tmp_path, data_root, tiny_llama_dir, other_tokenizer_dir):
    """Phase 2 with kept_rows_learning_rate far below embedding_learning_rate, sharded over two processes
    (FSDP2 DTensor rows): the base model's own rows hardly move, the new rows and the backbone do."""
    import torch
    from safetensors.torch import load_file

    cpt = cpt_section(
        scratch_model=None,
        base_model=str(tiny_llama_dir),
        transplant="mean_of_pieces",
        num_processes_per_node=2,
        phase1={"num_steps": 0},
        phase2={
            "num_steps": 2,
            "learning_rate": 0.01,
            "embedding_learning_rate": 0.01,
            "kept_rows_learning_rate": 1e-9,
            "num_warmup_steps": 0,
        },
    )
    run_cpt(tmp_path, data_root, other_tokenizer_dir, cpt)
    art = artifact(tmp_path / "store")
    before = load_file(str(tiny_llama_dir / "model.safetensors"))
    after = load_file(str(art.path / "model.safetensors"))
    from tokenizers import Tokenizer

    base_vocab = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json")).get_vocab()
    new_vocab = Tokenizer.from_file(str(art.path / "tokenizer.json")).get_vocab()
    pairs = torch.tensor([(base_vocab[t], new_vocab[t]) for t in base_vocab if t in new_vocab])
    assert len(pairs) > 256
    emb_before, emb_after = before["model.embed_tokens.weight"], after["model.embed_tokens.weight"]
    kept_change = (emb_after[pairs[:, 1]] - emb_before[pairs[:, 0]]).abs().max()
    assert float(kept_change) < 1e-6, kept_change  # at embedding_learning_rate they would move like the backbone
    backbone = [k for k in before if "embed_tokens" not in k and "lm_head" not in k]
    moved = max(float((before[k] - after[k]).abs().max()) for k in backbone)
    assert moved > 1e-3, moved


def test_bad_inputs_fail_clearly_and_publish_nothing(
    tmp_path, data_root, tiny_llama_dir, other_tokenizer_dir, tiny_tokenizer_dir
):
    # tokenizer differs from the base model's and transplant is off
    a = tmp_path / "mismatch"
    a.mkdir()
    proc = run_cpt(
        a,
        data_root,
        other_tokenizer_dir,
        cpt_section(scratch_model=None, base_model=str(tiny_llama_dir), transplant="none"),
        check=False,
    )
    assert proc.returncode != 0
    assert "differs from the base model's tokenizer" in proc.stderr + proc.stdout
    assert not published(a / "store")

    # a corpus shorter than one window
    b = tmp_path / "short"
    b.mkdir()
    short = b / "short.txt"
    short.write_text("Salam.\nSağ ol.\n")
    proc = run_cpt(b, data_root, tiny_tokenizer_dir, cpt_section(corpora=[{"uri": str(short)}]), check=False)
    assert proc.returncode != 0
    assert "fewer than one training window of seq_len=64" in proc.stderr + proc.stdout
    assert not published(b / "store")

    # an unknown config field is rejected before anything runs
    c = tmp_path / "unknown"
    c.mkdir()
    proc = run_cpt(c, data_root, tiny_tokenizer_dir, cpt_section(learning_rate=0.1), check=False)
    assert proc.returncode != 0
    assert "cpt.learning_rate" in proc.stderr and "Extra inputs are not permitted" in proc.stderr
    assert not published(c / "store")


def test_non_finite_loss_stops_with_checkpoint_and_clear_error(tmp_path, data_root, tiny_tokenizer_dir):
    """An lr of 1e30 blows the weights up after one step (1e38 overflows inside AdamW itself); the next
    step's loss is still finite but its gradient norm is inf. The run must stop without stepping,
    keep a checkpoint of the last good state, name step/phase/lr, and publish nothing."""
    import re

    section = cpt_section(
        phase1={"num_steps": 0},
        phase2={"num_steps": 6, "learning_rate": 1e30},
        max_grad_norm=None,
        eval_every=100,
        checkpoint_every=100,
    )
    proc = run_cpt(tmp_path, data_root, tiny_tokenizer_dir, section, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    found = re.search(
        r"non-finite (training loss|gradient norm) \(.*?\) at step (\d+) \(phase 2, lr [0-9e.+]+\).*"
        r"checkpoint saved at step (\d+)",
        output,
    )
    assert found, output[-3000:]
    assert (int(found[2]), int(found[3])) == (2, 1)  # stopped at the first bad step, before any bad update
    assert not published(tmp_path / "store")
    (opt_root,) = [p for p in (tmp_path / "work").glob("cpt-*") if p.is_dir()]  # kept after a failure: a rerun resumes
    assert (
        len(re.findall("non-finite (training loss|gradient norm)", (opt_root / "output" / "failure").read_text())) == 1
    )
    # the last good state is a complete checkpoint (the token cache also lives under checkpoints/)
    marker = opt_root / "checkpoints" / "train" / f"step-{int(found[3]):08d}" / "COMPLETE.node00000-of-00001"
    assert marker.is_file(), output[-3000:]


def test_output_is_golden_for_its_code_version(single_run):
    """The cpt stage's code version is bumped whenever what it publishes for this run changes (tests/golden.py)."""
    import golden

    m = single_run.manifest.metrics
    golden.check(
        "cpt",
        {
            "files": sorted(f.path for f in single_run.manifest.files),
            "losses": [h["loss"] for h in m["history"]],
            **{k: m[k] for k in ("step0_val_bpb", "final_val_bpb", "final_val_loss", "num_params", "total_tokens")},
        },
    )


@pytest.fixture(scope="module")
def extended_tokenizer_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """The tiny tokenizer with a few Azerbaijani words added: every base token kept (an extension)."""
    import shutil

    from tokenizers import Tokenizer

    out = tmp_path_factory.mktemp("tokext") / "tokenizer"
    shutil.copytree(tiny_tokenizer_dir, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens(["Azərbaycan", "Respublikası", "şəhər", " və ", "ğı", "lar", "ində"])
    tok.save(str(out / "tokenizer.json"))
    return out


def test_leakage_of_the_trained_initialisation(tmp_path, data_root, tiny_llama_dir, extended_tokenizer_dir):
    """An extension of the base tokenizer: the step-0 leakage row of the trained initialisation (and only
    that one: no comparison of initialisations in the stage) holds the base model's BPB and a base
    tokenisation never better than it; leakage is recorded at step 0 and at every validation."""
    cpt = cpt_section(
        scratch_model=None,
        base_model=str(tiny_llama_dir),
        corpora=[
            {"uri": WIKI, "name": "az-wiki"},
            {"uri": "${DILFORGE_DATA}/az/train/tatoeba_aze-eng.tsv", "text_field": "eng", "name": "en-replay"},
        ],
        validation=[
            {"uri": FLORES, "text_field": "azj_Latn", "name": "az"},
            {"uri": FLORES, "text_field": "eng_Latn", "name": "en"},
        ],
        num_validation_docs=12,
        eval_every=1,
        phase1={"num_steps": 2, "learning_rate": 0.01, "trainable": "new_rows"},
        phase2={"num_steps": 0},
    )
    run_cpt(tmp_path, data_root, extended_tokenizer_dir, cpt)
    m = artifact(tmp_path / "store").manifest.metrics
    table = m["transplant"]["step0_leakage"]
    assert set(table) == {"mean_of_pieces"} and set(m["transplant"]["step0_val_bpb"]) == {"mean_of_pieces"}
    for name in ("az", "en"):
        row = table["mean_of_pieces"][name]
        assert row["base_tokenization_vs_base"] >= 1 - 1e-9 and row["bpb_base_model"] > 0
    assert [entry["step"] for entry in m["leakage"]] == [0, 1, 2]
    assert all(set(entry["sets"]) == {"az", "en"} for entry in m["leakage"])
    assert [row["step"] for row in m["validation"]] == [0, 1, 2]
