"""Bits per byte of an eval text set: the shared definition (`dilforge_shared.bpb.sliding_window_bpb`)
applied with a transformers tokenizer, whose family (`dilforge_shared.families`) gives the document
separators. CPT validation computes the same number for the same model, text and window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from dilforge_shared.bpb import BpbResult as _SharedResult
from dilforge_shared.bpb import TokenStream, build_stream, sliding_window_bpb, window_plan
from dilforge_shared.families import detect_family

__all__ = [
    "BpbResult",
    "TokenStream",
    "bits_per_byte",
    "default_window",
    "encode_stream",
    "pack",
    "text_bytes",
    "window_plan",
]


class BpbResult(_SharedResult):
    """The shared result plus the summary row eval's report and manifest use."""

    def summary(self) -> dict:
        return {
            "bpb": round(self.bpb, 5),
            "bits_per_token": round(self.bits_per_token, 5),
            "bytes_per_second": round(self.num_bytes / self.seconds, 1) if self.seconds else None,
            **{k: v for k, v in asdict(self).items() if k != "nll_nats"},
            "bits": round(self.bits, 3),
        }


def pack(docs: Sequence[str]) -> str:
    """The documents as one newline-joined text (for display and digests; BPB counts `text_bytes`)."""
    return "\n".join(docs)


def text_bytes(docs: Sequence[str]) -> int:
    """The BPB denominator: UTF-8 bytes of the documents' text (separators are not text)."""
    return sum(len(d.encode("utf-8")) for d in docs)


def encode_stream(tokenizer, docs: Sequence[str], source: str = "tokenizer") -> TokenStream:
    """The documents as one stream framed by the tokenizer family's separators (see dilforge_shared.bpb)."""
    family = detect_family(tokenizer.get_vocab(), source)
    bos = tokenizer.convert_tokens_to_ids(family.bos) if family.bos is not None else None
    doc_end = tokenizer.convert_tokens_to_ids(family.doc_end)
    encoded = [tokenizer(doc, add_special_tokens=False)["input_ids"] for doc in docs]
    return build_stream(list(docs), encoded, bos, doc_end)


def bits_per_byte(model, tokenizer, docs: Sequence[str], window: int, stride: int, batch_size: int = 8) -> BpbResult:
    result = sliding_window_bpb(model, encode_stream(tokenizer, docs), window, stride, batch_size)
    return BpbResult(**asdict(result))


def default_window(model, requested: int | None, cap: int = 2048) -> int:
    limit = getattr(model.config, "max_position_embeddings", None) or cap
    return min(requested or cap, limit) if requested else min(limit, cap)
