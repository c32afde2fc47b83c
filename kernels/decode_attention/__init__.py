"""Decode attention: one query token per row against its slot or paged K/V (GQA, per-row lengths, flash-decoding)."""
