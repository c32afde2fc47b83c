"""Decode chain, the spec: one decode step of one row through all L decoder layers of a dense Llama-style model
(Qwen3, Qwen2, Llama, Mistral), layer after layer as the fused decode layer computes it
(``prime_spmd/inference/runner.py: make_decode_layer`` with the Triton linears and fused attention):

    qkv = decode_linear(x, qkv_w, qkv_b, norm ln1)                         (kernels/decode_linear)
    o   = fused_decode_attention(qkv, q/k norm, RoPE at pos, cache write)  (kernels/decode_attention)
    xm  = decode_linear(o, o_w, o_b, residual x)
    h   = decode_linear(xm, gate_up_w, norm ln2, act silu_mul)
    x'  = decode_linear(h, down_w, residual xm)

Each layer's new k / v is written to its slot-cache layer at ``pos`` (row 0 = slot 0). Returns x after the last layer.

Legend (docs/conventions.md): L layers, D hidden, I intermediate, N query heads, Nkv kv heads, Dh head dim,
Bc cache slots, Tc positions per slot.
"""

from __future__ import annotations

import torch
from prime_spmd.kernels.decode_attention.reference import fused_decode_attention_reference
from prime_spmd.kernels.decode_linear.reference import decode_linear_reference

LAYER_WEIGHTS = ("ln1", "qkv_w", "qkv_b", "q_norm", "k_norm", "o_w", "o_b", "ln2", "gate_up_w", "down_w")
"""A layer's weights, in the order ``LlamaStyleRunner.layer_args`` holds them (biases and q/k norms may be None)."""


def decode_chain_reference(
    x_1D: torch.Tensor,
    layers: list[tuple],
    k_LBcNkvTcDh: torch.Tensor,
    v_LBcNkvTcDh: torch.Tensor,
    num_heads: int,
    cos_1Dh: torch.Tensor,
    sin_1Dh: torch.Tensor,
    pos_1: torch.Tensor,
    kv_len: int,
    scale: float,
    eps: float,
) -> torch.Tensor:
    """x [1, D] after all layers (``layers[l]``: the weights of ``LAYER_WEIGHTS``); writes each layer's k / v at
    ``pos_1[0]`` of slot 0 and attends positions [0, pos + 1) (within ``kv_len``). Mutates the caches."""
    lens_1 = (pos_1 + 1).clamp(max=kv_len)
    x = x_1D
    for li, (ln1, qkv_w, qkv_b, qn, kn, o_w, o_b, ln2, gate_up_w, down_w) in enumerate(layers):
        qkv = decode_linear_reference(x, qkv_w, qkv_b, ln1, eps)
        o = fused_decode_attention_reference(
            qkv, num_heads, qn, kn, cos_1Dh, sin_1Dh, pos_1, k_LBcNkvTcDh[li], v_LBcNkvTcDh[li], None, lens_1, kv_len,
            scale, eps,
        ).reshape(1, -1)  # fmt: skip
        xm = decode_linear_reference(o, o_w, o_b, None, eps, x)
        h = decode_linear_reference(xm, gate_up_w, None, ln2, eps, None, "silu_mul")
        x = decode_linear_reference(h, down_w, None, None, eps, xm)
    return x
