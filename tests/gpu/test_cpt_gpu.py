"""CPT on one CUDA GPU: bf16 compute with Liger (fused linear cross entropy: no logits tensor), and
a run stopped by SIGTERM resumes to the uninterrupted run's loss (within the GPU's own run-to-run noise)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_helpers import stage_env

SCRATCH = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def cpt_config(data: dict, **overrides):
    from dilforge_cpt.config import CptConfig

    section = {
        "scratch_model": SCRATCH,
        "corpora": [{"uri": str(data["train"])}],
        "validation": [{"uri": str(data["valid"])}],
        "num_validation_docs": 50,
        "seq_len": 256,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "precision": "bf16",
        "liger": "on",
        "phase1": {"num_steps": 2, "learning_rate": 0.01},
        "phase2": {"num_steps": 10, "learning_rate": 0.003, "num_warmup_steps": 2},
        "log_every": 1,
        "eval_every": 6,
        "checkpoint_every": 4,
    }
    section.update(overrides)
    return CptConfig.model_validate(section)


def full(param):
    """A parameter's whole value as a plain fp32 tensor (FSDP2 holds DTensor shards)."""
    value = param.detach()
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).float()


def test_bf16_liger_step_never_materialises_logits(gpu_data):
    """In a child process, as the stage runs: Liger patches the whole process it is applied in."""
    here = Path(__file__).resolve().parent
    env = stage_env()
    bench = here.parents[1] / "bench"
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), str(bench), env["PYTHONPATH"]])
    code = "import sys, test_cpt_gpu as t; t.fused_step_main(sys.argv[1], sys.argv[2])"
    argv = [sys.executable, "-c", code, str(gpu_data["train"]), str(gpu_data["valid"])]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0 and "fused step: ok" in proc.stdout, (proc.stdout[-3000:], proc.stderr[-5000:])


def fused_step_main(train: str, valid: str) -> None:
    import torch
    from dilforge_cpt import runtime

    config = cpt_config({"train": train, "valid": valid})
    rt = runtime.init_runtime(config)
    try:
        assert rt.cuda and rt.dtype == torch.bfloat16 and rt.fsdp  # one GPU: one-rank FSDP2, bf16 mixed precision
        check_fused_step(rt, config)
    finally:
        runtime.shutdown(rt)
    print("fused step: ok", flush=True)


def check_fused_step(rt, config) -> None:
    """One stage step (run_step, read back) with Liger on a model whose logits would be the largest tensor by far; the
    kernels that RAN are counted."""
    import torch
    from cpt_steps import train_step
    from dilforge_cpt import optim, sharding
    from factories import tiny_llama_config
    from liger_probe import counting_calls, liger_functions, liger_parts
    from transformers import LlamaForCausalLM

    # sized so that one fp32 logits tensor (2 GiB) dwarfs everything else the step holds (~0.6 GiB:
    # weights, bf16 copies, grads, AdamW state, activations): a peak below half of it proves FLCE
    vocab, batch, seq = 65536, 8, 1024
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab, hidden_size=256, intermediate_size=704, num_hidden_layers=4))
    kernels = sharding.apply_liger(model, config, rt)
    assert {"fused_linear_cross_entropy", "rms_norm", "rope", "swiglu"} <= set(kernels)
    # Liger binds forwards on the instance (class names stay LlamaRMSNorm/LlamaMLP)
    assert {"<model>", "model.norm", "model.layers.0.mlp"} <= set(liger_parts(model))
    model = sharding.shard_model(model, config, rt)
    head_calls, q_dtypes = [], []
    model.get_output_embeddings().register_forward_hook(lambda *a: head_calls.append(1))
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: q_dtypes.append(o.dtype))
    trainable = optim.set_trainable(model, 2)
    params = trainable.params
    optimizer = optim.make_optimizer(trainable, config, config.phase2, fused=True)
    before = {n: full(p).clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, vocab, (batch, seq)).numpy()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with counting_calls(liger_functions()) as ran:
        loss, norm = train_step(model, optimizer, [tokens], rt, 1.0)
    torch.cuda.synchronize()
    peak_extra = torch.cuda.max_memory_allocated() - base
    logits_fp32 = batch * seq * vocab * 4
    # every kernel applied ran: 2 norms per layer + the final one, one SwiGLU and one RoPE per layer, one FLCE
    assert ran == {"rms_norm": 9, "swiglu": 4, "rope": 4, "fused_linear_cross_entropy": 1}, ran
    assert head_calls == []  # the LM head module never ran: FLCE used its weight directly
    assert peak_extra < logits_fp32 / 2, (peak_extra, logits_fp32)  # no full logits tensor was ever allocated
    x = torch.from_numpy(tokens[:1]).cuda()
    assert model(input_ids=x, labels=x).logits is None  # FLCE returns the loss only
    assert q_dtypes and set(q_dtypes) == {torch.bfloat16}  # compute in bf16
    assert all(p.dtype == torch.float32 for p in params)  # fp32 master weights
    assert torch.isfinite(torch.tensor([loss, norm])).all()
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], full(p))]
    assert len(changed) == len(before)


# ---- through the stage's entrypoint (the container contract), as SageMaker runs it -----------------------


def publish_tokenizer(store: Path, tok_dir: Path) -> str:
    from dilforge_shared.manifest import Manifest, current_producer
    from dilforge_shared.store import publish

    uri = f"{store}/artifacts/tokenizer/gputok"
    if not (Path(uri) / "manifest.json").exists():
        publish(
            uri,
            tok_dir,
            Manifest(
                code_version="test",
                kind="tokenizer",
                artifact_id="gputok",
                run_id="gpu",
                stage="tokenizer",
                producer=current_producer("dilforge-tokenizer"),
                config={},
                data_dir="pending",
                files=[],
            ),
        )
    return uri


def stage_process(opt_root: Path) -> subprocess.Popen:
    from dilforge_shared.contract import OPT_ML_ENV

    env = {**stage_env(), OPT_ML_ENV: str(opt_root), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    return subprocess.Popen(
        [sys.executable, "-m", "dilforge_cpt", "train"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def start_stage(root: Path, name: str, config, tok_uri: str) -> tuple[subprocess.Popen, Path]:
    from dilforge_coordinator.backends.local import write_inputs
    from dilforge_coordinator.pipeline import build_hyperparameters
    from dilforge_shared.contract import OptMl

    opt = OptMl(root / f"optml-{name}")
    write_inputs(opt, build_hyperparameters(config, str(root / "out" / name), "gpu", {"tokenizer": tok_uri}))
    return stage_process(opt.root), opt.root


def finish(proc: subprocess.Popen, stop_after_step: int | None = None) -> tuple[int, str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if stop_after_step is not None and f" step={stop_after_step} " in line:
            proc.send_signal(signal.SIGTERM)
            stop_after_step = None
    return proc.wait(timeout=600), "".join(lines)


def history(root: Path, name: str) -> list[dict]:
    from dilforge_shared.store import fetch

    return fetch(str(root / "out" / name)).manifest.metrics["history"]


def test_sigterm_then_rerun_resumes_to_the_uninterrupted_loss(gpu_data, llama3_tokenizer_dir, tmp_path, results_dir):
    config = cpt_config(gpu_data)
    tok_uri = publish_tokenizer(tmp_path / "store", llama3_tokenizer_dir)
    # two uninterrupted runs measure the GPU's run-to-run noise (atomics in some backward kernels)
    refs = []
    for name in ("ref_a", "ref_b"):
        rc, text = finish(start_stage(tmp_path, name, config, tok_uri)[0])
        assert rc == 0, text[-4000:]
        refs.append([h["loss"] for h in history(tmp_path, name)])
    proc, opt_root = start_stage(tmp_path, "resumed", config, tok_uri)
    rc, text = finish(proc, stop_after_step=5)
    assert rc != 0 and "SIGTERM" in text, text[-4000:]
    assert not (tmp_path / "out" / "resumed" / "manifest.json").exists()
    rc, text = finish(stage_process(opt_root))
    assert rc == 0 and "resumed from checkpoint" in text, text[-4000:]
    resumed = [h["loss"] for h in history(tmp_path, "resumed")]
    noise = max(abs(a - b) / abs(a) for a, b in zip(*refs, strict=False))
    tolerance = max(1e-6, 2 * noise)
    assert len(resumed) == len(refs[0]) == 12
    assert resumed == pytest.approx(refs[0], rel=tolerance)
    if results_dir:
        (results_dir / "cpt_resume.json").write_text(
            json.dumps({"reference": refs, "resumed": resumed, "run_to_run_noise": noise, "tolerance": tolerance})
        )
