"""Decode attention: one query token per row against its slot's cached K/V (GQA, per-row lengths, flash-decoding)."""
