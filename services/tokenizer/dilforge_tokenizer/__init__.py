"""Tokenizer stage: learn, extend or measure a Llama-3-compatible byte-level BPE."""
