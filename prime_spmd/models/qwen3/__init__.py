"""Qwen3 dense and Qwen3-MoE: model code (model.py), HF name mapping and loading (hf.py), flavors here."""

from __future__ import annotations


def _dense(hidden: int, intermediate: int, layers: int, heads: int, tie: bool) -> dict:
    """HF config.json fields of a dense Qwen3 shape (8 KV heads of 128 dims, Qwen3's vocabulary and RoPE base)."""
    return dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=tie,
        rope_theta=1e6,
    )


_QWEN3_30B_A3B = {
    **_dense(2048, 6144, 48, 32, tie=False),
    "model_type": "qwen3_moe",
    "num_key_value_heads": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
}

# HF config.json fields of the published Qwen3 shapes, for benchmarks (random init) and tests.
FLAVORS: dict[str, dict] = {
    "qwen3-0.6b": _dense(1024, 3072, 28, 16, tie=True),
    "qwen3-1.7b": _dense(2048, 6144, 28, 16, tie=True),
    "qwen3-4b": _dense(2560, 9728, 36, 32, tie=True),
    "qwen3-8b": _dense(4096, 12288, 36, 32, tie=False),
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    # Qwen3-30B-A3B layer shapes with 8 layers: fits one GPU with full-parameter AdamW.
    "qwen3-moe-8l": {**_QWEN3_30B_A3B, "num_hidden_layers": 8},
}
