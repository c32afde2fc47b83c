"""The entry point the native engine uses: ``decode_attention(..., impl=...)``.

``reference``: pure PyTorch (reference.py), any device. ``triton``: the flash-decoding kernels
(kernel.py) as the ``torch.library`` op ``prime_spmd::decode_attention``, with a fake impl so it
sits inside ``torch.compile(fullgraph=True)`` and CUDA-graph capture. Inference only: no backward
is registered, so a backward through the triton op raises.

Legend: see reference.py (B rows, N query heads, Nkv kv heads, Dh head dim, Bc cache slots, Tc cache length).
"""

from __future__ import annotations

from typing import Literal

import torch

from kernels.decode_attention.reference import decode_attention_reference

DecodeAttentionImpl = Literal["reference", "triton"]


def check_inputs(
    q_BNDh: torch.Tensor, k_BcNkvTcDh: torch.Tensor, v_BcNkvTcDh: torch.Tensor, lens_B: torch.Tensor, max_len: int
):
    """ValueError naming the bad shape, dtype or size (host-side metadata only: no device sync)."""
    if q_BNDh.ndim != 3 or k_BcNkvTcDh.ndim != 4 or k_BcNkvTcDh.shape != v_BcNkvTcDh.shape:
        raise ValueError(
            f"decode_attention: want q [B, N, Dh] and k, v [Bc, Nkv, Tc, Dh]; got q {tuple(q_BNDh.shape)}, "
            f"k {tuple(k_BcNkvTcDh.shape)}, v {tuple(v_BcNkvTcDh.shape)}"
        )
    (B, N, Dh), (Bc, Nkv, Tc, Dh_k) = q_BNDh.shape, k_BcNkvTcDh.shape
    if Dh_k != Dh or N % Nkv or B > Bc:
        raise ValueError(
            f"decode_attention: q {tuple(q_BNDh.shape)} does not fit cache {tuple(k_BcNkvTcDh.shape)} "
            f"(need the same Dh, N a multiple of Nkv, B <= Bc)"
        )
    if not 1 <= max_len <= Tc:
        raise ValueError(f"decode_attention: max_len={max_len} outside [1, {Tc}] (the cache length)")
    if lens_B.shape != (B,) or lens_B.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"decode_attention: lens_B must be int32/int64 [{B}], got {lens_B.dtype} {tuple(lens_B.shape)}"
        )
    if not (q_BNDh.dtype == k_BcNkvTcDh.dtype == v_BcNkvTcDh.dtype):
        raise ValueError(
            f"decode_attention: dtypes differ: q {q_BNDh.dtype}, k {k_BcNkvTcDh.dtype}, v {v_BcNkvTcDh.dtype}"
        )


def decode_attention(
    q_BNDh: torch.Tensor,
    k_BcNkvTcDh: torch.Tensor,
    v_BcNkvTcDh: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    impl: DecodeAttentionImpl = "reference",
    num_splits: int = 0,
) -> torch.Tensor:
    """Attention of q [B, N, Dh] over positions [0, min(lens_B[b], max_len)) of cache slot b; [B, N, Dh].

    ``k/v_BcNkvTcDh`` [Bc, Nkv, Tc, Dh], N = G Nkv; ``lens_B`` int [B] on q's device, each >= 1; ``max_len`` a
    static bound (the triton grid is sized by it; a longer length is clamped to it). ``num_splits``
    (triton): length splits per (row, kv head), 0 = chosen by shape. No side effects.
    """
    check_inputs(q_BNDh, k_BcNkvTcDh, v_BcNkvTcDh, lens_B, max_len)
    if impl == "reference":
        return decode_attention_reference(q_BNDh, k_BcNkvTcDh, v_BcNkvTcDh, lens_B, max_len, scale)
    if impl == "triton":
        return torch.ops.prime_spmd.decode_attention(
            q_BNDh, k_BcNkvTcDh, v_BcNkvTcDh, lens_B, max_len, scale, num_splits
        )
    raise ValueError(f"unknown decode attention impl {impl!r}; choose reference or triton")


@torch.library.custom_op("prime_spmd::decode_attention", mutates_args=())
def decode_attention_op(
    q_BNDh: torch.Tensor,
    k_BcNkvTcDh: torch.Tensor,
    v_BcNkvTcDh: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    num_splits: int,
) -> torch.Tensor:
    """The Triton kernels (kernel.decode_attention); inputs as ``decode_attention`` above."""
    from kernels.decode_attention import kernel

    return kernel.decode_attention(q_BNDh, k_BcNkvTcDh, v_BcNkvTcDh, lens_B, max_len, scale, num_splits)


@decode_attention_op.register_fake
def _(q_BNDh, k_BcNkvTcDh, v_BcNkvTcDh, lens_B, max_len, scale, num_splits):
    return torch.empty_like(q_BNDh)
