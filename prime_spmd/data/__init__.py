"""Datasets: the seeded reverse-text generator and local JSONL/Parquet SFT files."""
