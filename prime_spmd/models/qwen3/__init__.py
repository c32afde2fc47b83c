"""Qwen3 dense and Qwen3-MoE: model code (model.py), HF name mapping and loading (hf.py), flavors here."""

from __future__ import annotations

_QWEN3_30B_A3B = dict(
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    tie_word_embeddings=False,
    rope_theta=1e6,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
)

# HF config.json fields of reference shapes, for benchmarks (random init) and tests.
FLAVORS: dict[str, dict] = {
    "qwen3-0.6b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    "qwen3-1.7b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    "qwen3-4b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    "qwen3-8b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        rope_theta=1e6,
    ),
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    # Qwen3-30B-A3B layer shapes with 8 layers: fits one GPU with full-parameter AdamW.
    "qwen3-moe-8l": {**_QWEN3_30B_A3B, "num_hidden_layers": 8},
}
