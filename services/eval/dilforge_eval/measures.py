"""Per tokenizer: fertility, parity with English, morpheme alignment; per model: bits per byte (the shared
`bpb.stream_nll` on the tokenizer family's framing, so CPT validation computes the same number)."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from dilforge_shared.bpb import TokenStream, build_stream, eval_mode, stream_nll
from dilforge_shared.families import detect_family
from dilforge_shared.fertility import SetFigures, measure, tokenizers_encoder

from . import morph as morph_mod
from .metrics import BpbFigures, MorphFigures, ParityFigures

log = logging.getLogger("dilforge.eval")


@dataclass
class BpbResult:  # one stream's `sliding_window_bpb`
    nll_nats: float
    num_bytes: int
    num_tokens: int  # text tokens scored (separators excluded)
    num_windows: int
    seconds: float

    @property
    def bits(self) -> float:
        return self.nll_nats / math.log(2)

    @property
    def bpb(self) -> float:
        return self.bits / self.num_bytes if self.num_bytes else float("nan")

    @property
    def bits_per_token(self) -> float:
        return self.bits / self.num_tokens if self.num_tokens else float("nan")


@torch.no_grad()
def sliding_window_bpb(model, stream: TokenStream, window: int, stride: int, batch_size: int = 8, on_batch=None):
    """BPB of one stream in one process (a `BpbResult`), by the shared definition (`dilforge_shared.bpb`)."""
    start = time.perf_counter()
    with eval_mode(model):
        nll, scored, windows = stream_nll(model, stream, window, stride, batch_size, on_batch=on_batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return BpbResult(nll, stream.num_bytes, scored, windows, time.perf_counter() - start)


def text_bytes(docs: Sequence[str]) -> int:
    """The BPB denominator: UTF-8 bytes of the documents' text (separators are not text)."""
    return sum(len(d.encode("utf-8")) for d in docs)


def encode_stream(tokenizer, docs: Sequence[str]) -> TokenStream:
    """The documents as one stream framed by the tokenizer family's separators (see dilforge_shared.bpb)."""
    family = detect_family(tokenizer.get_vocab(), "tokenizer")
    bos = tokenizer.convert_tokens_to_ids(family.bos) if family.bos is not None else None
    doc_end = tokenizer.convert_tokens_to_ids(family.doc_end)
    encoded = [tokenizer(doc, add_special_tokens=False)["input_ids"] for doc in docs]
    return build_stream(list(docs), encoded, bos, doc_end)


def bits_per_byte(
    model, tokenizer, docs: Sequence[str], window: int, stride: int, batch_size: int = 8, on_batch=None
) -> BpbResult:
    return sliding_window_bpb(model, encode_stream(tokenizer, docs), window, stride, batch_size, on_batch=on_batch)


def bpb_summary(res: BpbResult) -> BpbFigures:
    """The row eval's report and manifest keep for one model and set."""
    return BpbFigures(
        bpb=round(res.bpb, 5),
        bits_per_token=round(res.bits_per_token, 5),
        bytes_per_second=round(res.num_bytes / res.seconds, 1) if res.seconds else None,
        **{k: v for k, v in asdict(res).items() if k != "nll_nats"},
        bits=round(res.bits, 3),
    )


def default_window(model, requested: int | None, cap: int = 2048) -> int:
    limit = getattr(model.config, "max_position_embeddings", None) or cap
    return min(requested or cap, limit)


def tokenizer_metrics(toks, sets: dict[str, list[str]]) -> dict[str, dict[str, SetFigures]]:
    return {
        label: {name: measure(docs, tokenizers_encoder(tok)) for name, docs in sets.items()}
        for label, tok in toks.items()
    }


def parity_metrics(toks, parallel: dict[str, list[tuple[str, str]]]) -> dict[str, dict[str, ParityFigures]]:
    out: dict = {}
    for label, tok in toks.items():
        for name, pairs in parallel.items():
            az = sum(len(e.ids) for e in tok.encode_batch([p[0] for p in pairs], add_special_tokens=False))
            en = sum(len(e.ids) for e in tok.encode_batch([p[1] for p in pairs], add_special_tokens=False))
            out.setdefault(label, {})[name] = ParityFigures(
                tokens_az=az, tokens_en=en, num_pairs=len(pairs), parity=round(az / en, 4) if en else None
            )
    return out


def morph_metrics(toks, gold: dict[str, list[morph_mod.GoldWord]]) -> dict[str, dict[str, MorphFigures]]:
    """Per tokenizer and gold source (and "all" of them, when there are several): the morpheme alignment."""
    out: dict = {}
    for label, tok in toks.items():
        counts = {source: morph_mod.alignment(tok, words) for source, words in gold.items()}
        if len(gold) > 1:
            counts["all"] = sum(counts.values(), Counter())
        out[label] = {source: morph_mod.figures(n) for source, n in counts.items()}
    return out
