"""SFT on one CUDA GPU: bf16 + Liger + padding-free packing with a kernel that keeps documents apart."""

from __future__ import annotations

import itertools
import json
import math


def sft_config(data: dict, **overrides):
    from dilforge_sft.config import SftConfig

    section = {
        "train": [{"uri": str(data["chat"])}],
        "validation": [{"uri": str(data["chat"]), "max_docs": 8}],
        "max_length": 512,
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "packing": True,
        "learning_rate": 3e-3,
        "num_steps": 3,
        "micro_batch_size": 2,
        "global_batch_size": 2,
        "warmup_ratio": 0.0,
        "log_every": 1,
    }
    section.update(overrides)
    return SftConfig.model_validate(section)


def test_packed_flex_or_flash_attention_keeps_documents_apart_on_cuda(chatml_llama_dir, gpu_data, tmp_path):
    """The kernel auto picks on CUDA gives each packed conversation the logits it gets alone."""
    import torch
    from dilforge_sft import stage, training
    from transformers import AutoModelForCausalLM

    config = sft_config(gpu_data)
    auto = training.decide_runtime(config)
    assert auto.attention in ("flex_attention", "flash_attention_2")
    plan = training.decide_runtime(config.model_copy(update={"precision": "fp32", "liger": "off", "attention": "sdpa"}))
    tok, _, _ = stage.load_tokenizer(chatml_llama_dir)
    train, val, _, _ = stage.prepare_data(config, tok, None)
    trainer = training.build_trainer(
        config, training.load_model(chatml_llama_dir, plan), tok, train, val, tmp_path, plan
    )
    batch = trainer.data_collator([trainer.train_dataset[0], trainer.train_dataset[1]])
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    dtype = torch.float32 if auto.attention == "flex_attention" else torch.bfloat16
    model = (
        AutoModelForCausalLM.from_pretrained(
            str(chatml_llama_dir), attn_implementation=auto.attention, dtype=dtype, trust_remote_code=False
        )
        .cuda()
        .eval()
    )
    ids, pos = batch["input_ids"].cuda(), batch["position_ids"].cuda()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
        starts = (pos[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        assert len(starts) > 2
        for begin, end in itertools.pairwise(starts):
            alone = model(input_ids=ids[:, begin:end], use_cache=False).logits[0].float()
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(packed[begin:end], alone, atol=tol, rtol=tol)


def test_sft_bf16_liger_packing_trains(chatml_llama_dir, gpu_data, tmp_path, results_dir):
    import torch
    from dilforge_sft import stage, training

    config = sft_config(gpu_data)
    plan = training.decide_runtime(config)
    assert plan.device == "cuda" and plan.bf16 and plan.liger
    tok, family, _ = stage.load_tokenizer(chatml_llama_dir)
    assert family.name == "chatml"
    train, val, _, _ = stage.prepare_data(config, tok, None)
    model = training.load_model(chatml_llama_dir, plan)
    assert any(type(m).__name__.startswith("Liger") for m in model.modules())
    trainer = training.build_trainer(config, model, tok, train, val, tmp_path, plan)
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    before = trainer.evaluate()["eval_loss"]
    out = trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert out.global_step == 3 and math.isfinite(out.training_loss)
    assert all(not torch.equal(p, dict(trainer.model.named_parameters())[n].detach()) for n, p in lora_before.items())
    assert after < before
    if results_dir:
        (results_dir / "sft_gpu.json").write_text(
            json.dumps(
                {
                    "attention": plan.attention,
                    "reason": plan.attention_reason,
                    "eval_loss_before": before,
                    "eval_loss_after": after,
                    "train_runtime_s": out.metrics.get("train_runtime"),
                }
            )
        )
