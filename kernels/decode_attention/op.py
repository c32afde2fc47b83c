"""The entry point the native engine uses: ``decode_attention(..., impl=...)``.

``reference``: pure PyTorch (reference.py), any device. ``triton``: the flash-decoding kernels
(kernel.py) as the ``torch.library`` op ``prime_spmd::decode_attention``, with a fake impl so it
sits inside ``torch.compile(fullgraph=True)`` and CUDA-graph capture. Inference only: no backward
is registered, so a backward through the triton op raises.

Legend: see reference.py (B rows, H query heads, D head dim, S slots, J kv heads, L cache length).
"""

from __future__ import annotations

from typing import Literal

import torch

from kernels.decode_attention.reference import decode_attention_reference

DecodeAttentionImpl = Literal["reference", "triton"]


def check_inputs(q_BHD: torch.Tensor, k_SJLD: torch.Tensor, v_SJLD: torch.Tensor, lens_B: torch.Tensor, max_len: int):
    """ValueError naming the bad shape, dtype or size (host-side metadata only: no device sync)."""
    if q_BHD.ndim != 3 or k_SJLD.ndim != 4 or k_SJLD.shape != v_SJLD.shape:
        raise ValueError(
            f"decode_attention: want q [B, H, D] and k, v [S, J, L, D]; got q {tuple(q_BHD.shape)}, "
            f"k {tuple(k_SJLD.shape)}, v {tuple(v_SJLD.shape)}"
        )
    (b, h, d), (s, j, length, dk) = q_BHD.shape, k_SJLD.shape
    if dk != d or h % j or b > s:
        raise ValueError(
            f"decode_attention: q {tuple(q_BHD.shape)} does not fit cache {tuple(k_SJLD.shape)} (need the same D, "
            f"H a multiple of J, B <= S)"
        )
    if not 1 <= max_len <= length:
        raise ValueError(f"decode_attention: max_len={max_len} outside [1, {length}] (the cache length)")
    if lens_B.shape != (b,) or lens_B.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"decode_attention: lens_B must be int32/int64 [{b}], got {lens_B.dtype} {tuple(lens_B.shape)}"
        )
    if not (q_BHD.dtype == k_SJLD.dtype == v_SJLD.dtype):
        raise ValueError(f"decode_attention: dtypes differ: q {q_BHD.dtype}, k {k_SJLD.dtype}, v {v_SJLD.dtype}")


def decode_attention(
    q_BHD: torch.Tensor,
    k_SJLD: torch.Tensor,
    v_SJLD: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    impl: DecodeAttentionImpl = "reference",
    num_splits: int = 0,
) -> torch.Tensor:
    """Attention of q [B, H, D] over positions [0, min(lens_B[b], max_len)) of cache slot b; [B, H, D].

    ``k/v_SJLD`` [S, J, L, D], H = G J; ``lens_B`` int [B] on q's device, each >= 1; ``max_len`` a
    static bound (the triton grid is sized by it; a longer length is clamped to it). ``num_splits``
    (triton): length splits per (row, kv head), 0 = chosen by shape. No side effects.
    """
    check_inputs(q_BHD, k_SJLD, v_SJLD, lens_B, max_len)
    if impl == "reference":
        return decode_attention_reference(q_BHD, k_SJLD, v_SJLD, lens_B, max_len, scale)
    if impl == "triton":
        return torch.ops.prime_spmd.decode_attention(q_BHD, k_SJLD, v_SJLD, lens_B, max_len, scale, num_splits)
    raise ValueError(f"unknown decode attention impl {impl!r}; choose reference or triton")


@torch.library.custom_op("prime_spmd::decode_attention", mutates_args=())
def decode_attention_op(
    q_BHD: torch.Tensor,
    k_SJLD: torch.Tensor,
    v_SJLD: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    num_splits: int,
) -> torch.Tensor:
    """The Triton kernels (kernel.decode_attention); inputs as ``decode_attention`` above."""
    from kernels.decode_attention import kernel

    return kernel.decode_attention(q_BHD, k_SJLD, v_SJLD, lens_B, max_len, scale, num_splits)


@decode_attention_op.register_fake
def _(q_BHD, k_SJLD, v_SJLD, lens_B, max_len, scale, num_splits):
    return torch.empty_like(q_BHD)
