"""Decode attention, the spec: one new query token per row against that row's cached K/V.

Row b's query heads attend positions [0, min(lens_B[b], max_len)) of cache slot b; query head n
reads kv head n // G (GQA, G = N / Nkv). Softmax in fp32 over ``scale * q.k``; output in q's dtype.

Legend (docs/conventions.md): B rows (= slots 0..B-1), N query heads, Nkv kv heads, G = N / Nkv, Dh head
dim, Bc cache slots (>= B), Tc cache length per slot; local letter of this file: Tb = ``max_len`` (the
positions read).
"""

from __future__ import annotations

import torch


def decode_attention_reference(
    q_BNDh: torch.Tensor,
    k_BcNkvTcDh: torch.Tensor,
    v_BcNkvTcDh: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """o [B, N, Dh] in q's dtype. ``k/v_BcNkvTcDh`` [Bc, Nkv, Tc, Dh] (any strides), ``lens_B`` int [B], each
    >= 1 (a row of length 0 gives NaN); lengths above ``max_len`` (<= Tc) are clamped to it."""
    B, N, Dh = q_BNDh.shape
    Nkv = k_BcNkvTcDh.shape[1]
    k_BNkvTbDh = k_BcNkvTcDh[:B, :, :max_len].float()
    v_BNkvTbDh = v_BcNkvTcDh[:B, :, :max_len].float()
    q_BNkvGDh = q_BNDh.float().view(B, Nkv, N // Nkv, Dh)
    scores_BNkvGTb = torch.matmul(q_BNkvGDh, k_BNkvTbDh.transpose(-1, -2)) * scale
    visible_BTb = torch.arange(max_len, device=q_BNDh.device)[None, :] < lens_B[:, None].clamp(max=max_len)
    scores_BNkvGTb = scores_BNkvGTb.masked_fill(~visible_BTb[:, None, None], float("-inf"))
    o_BNkvGDh = torch.matmul(torch.softmax(scores_BNkvGTb, dim=-1), v_BNkvTbDh)
    return o_BNkvGDh.reshape(B, N, Dh).to(q_BNDh.dtype)
