"""Decode attention, the spec: one new query token per row against that row's cached K/V.

Row b's query heads attend positions [0, min(lens_B[b], max_len)) of cache slot b; query head h
reads kv head h // G (GQA, G = H / Hkv). Softmax in fp32 over ``scale * q.k``; output in q's dtype.

Legend (this folder): B rows (= slots 0..B-1), H query heads, D head dim, S cache slots (>= B),
J kv heads (Hkv), L cache length per slot.
"""

from __future__ import annotations

import torch


def decode_attention_reference(
    q_BHD: torch.Tensor,
    k_SJLD: torch.Tensor,
    v_SJLD: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """o [B, H, D] in q's dtype. ``k/v_SJLD`` [S, J, L, D] (any strides), ``lens_B`` int [B], each >= 1
    (a row of length 0 gives NaN); lengths above ``max_len`` (<= L) are clamped to it."""
    b, h, d = q_BHD.shape
    j = k_SJLD.shape[1]
    kc = k_SJLD[:b, :, :max_len].float()  # [B, J, Lb, D]
    vc = v_SJLD[:b, :, :max_len].float()
    q = q_BHD.float().view(b, j, h // j, d)  # [B, J, G, D]
    scores = torch.matmul(q, kc.transpose(-1, -2)) * scale  # [B, J, G, Lb]
    visible = torch.arange(max_len, device=q_BHD.device)[None, :] < lens_B[:, None].clamp(max=max_len)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1), vc)  # [B, J, G, D]
    return o.reshape(b, h, d).to(q_BHD.dtype)
