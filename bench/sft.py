"""SFT bench: the dilforge SFT stage's training steps/s against a bare TRL SFTTrainer run of the same config.

Same model (random Llama, 4 layers x 256 dim, Llama-3-style BPE trained on az wiki), same data (the
khazar08 SFT pairs), same LoRA, batch, max_length, steps and precision; both runs in this process,
alternated. The stage runs end to end through its container entrypoint (stage_main) with a local
store; its steps/s comes from the Trainer like the bare run's.

    OMP_NUM_THREADS=2 python bench/sft.py [--data ../shared/data] [--steps 20] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import hardware  # bench/hardware.py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def section(data: Path, model_dir: Path | None, steps: int) -> dict:
    s = {
        "train": [{"uri": str(data / "az/sft/khazar08_native_train.jsonl"), "layout": "instruction"}],
        "validation": [
            {"uri": str(data / "az/sft/khazar08_native_eval.jsonl"), "layout": "instruction", "max_docs": 8}
        ],
        "lora": {"r": 16, "alpha": 32},
        "max_length": 256,
        "learning_rate": 1e-3,
        "num_steps": steps,
        "micro_batch_size": 4,
        "global_batch_size": 4,
        "activation_checkpointing": False,
        "log_every": 5,
        "checkpoint_every": 10_000,
        "save_merged": False,
        "warmup_ratio": 0.0,
    }
    if model_dir:
        s["base_model"] = str(model_dir)
    return s


def run_stage(data: Path, model_dir: Path, steps: int, work: Path) -> float:
    from dilforge_coordinator.backends.local import write_inputs
    from dilforge_coordinator.pipeline import build_hyperparameters
    from dilforge_sft.config import SftConfig
    from dilforge_sft.stage import run
    from dilforge_shared.contract import OPT_ML_ENV, OptMl, stage_main
    from dilforge_shared.store import fetch

    opt = OptMl(Path(tempfile.mkdtemp(dir=work)))
    config = SftConfig.model_validate(section(data, model_dir, steps))
    write_inputs(opt, build_hyperparameters(config, str(opt.root / "store/sft"), "bench", {}))
    os.environ[OPT_ML_ENV] = str(opt.root)
    assert stage_main(SftConfig, run, "dilforge-sft", argv=["train"]) == 0, (
        opt.failure_file.read_text() if opt.failure_file.exists() else ""
    )
    return fetch(str(opt.root / "store/sft")).manifest.metrics["train_steps_per_second"]


def run_bare_trl(data: Path, model_dir: Path, steps: int, work: Path) -> float:
    """What a user would write with TRL directly: pairs → messages, SFTConfig, LoraConfig, train."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    rows = [json.loads(line) for line in (data / "az/sft/khazar08_native_train.jsonl").read_text().splitlines()]
    msgs = [
        {"messages": [{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["response"]}]}
        for r in rows
    ]
    cuda = torch.cuda.is_available()
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(dir=work),
        assistant_only_loss=True,
        max_length=256,
        learning_rate=1e-3,
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        gradient_checkpointing=False,
        bf16=cuda,
        use_cpu=not cuda,
        report_to="none",
        save_strategy="no",
        logging_steps=5,
        disable_tqdm=True,
        lr_scheduler_type="cosine",
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16 if cuda else torch.float32, trust_remote_code=False
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        processing_class=AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False),
        train_dataset=Dataset.from_list(msgs),
        peft_config=LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.05,
            task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    return trainer.train().metrics["train_steps_per_second"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path(os.environ.get("DILFORGE_DATA", ROOT.parent / "shared/data")))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    os.environ["DILFORGE_DATA"] = str(a.data.resolve())
    import factories

    print(hardware.describe("transformers", "trl", "peft"))
    work = Path(tempfile.mkdtemp(prefix="dilforge-bench-sft-"))
    tok = factories.build_tokenizer(work / "tok", vocab_size=2000, num_lines=5000)
    model = factories.build_tiny_llama(
        work / "model",
        tok,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    results: dict[str, list[float]] = {"bare TRL": [], "dilforge stage": []}
    for _ in range(a.repeats):
        t = time.perf_counter()
        results["bare TRL"].append(run_bare_trl(a.data, model, a.steps, work))
        print(f"bare TRL: {results['bare TRL'][-1]:.3f} steps/s ({time.perf_counter() - t:.1f} s wall)", flush=True)
        t = time.perf_counter()
        results["dilforge stage"].append(run_stage(a.data, model, a.steps, work))
        print(
            f"dilforge stage: {results['dilforge stage'][-1]:.3f} steps/s ({time.perf_counter() - t:.1f} s wall, "
            "incl. data rules, eval before/after, publish)",
            flush=True,
        )
    bare, ours = (statistics.median(results[k]) for k in ("bare TRL", "dilforge stage"))
    print(
        f"\nmodel: Llama 4x256, vocab {2000 + 256}, LoRA r16 on 7 projections, batch 4, max_length 256, "
        f"{a.steps} steps, {'bf16' if 'GPU none' not in hardware.describe() else 'fp32'}"
    )
    print(f"| run | train steps/s (median of {a.repeats}) | ratio |\n|---|---|---|")
    print(f"| bare TRL SFTTrainer | {bare:.3f} | 1.00 |\n| dilforge SFT stage | {ours:.3f} | {ours / bare:.2f} |")


if __name__ == "__main__":
    main()
