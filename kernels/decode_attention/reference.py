"""Decode attention, the spec: one new query token per row against that row's cached K/V.

Row b's query heads attend positions [0, min(lens_B[b], max_len)) of cache slot b; query head n
reads kv head n // G (GQA, G = N / Nkv). Softmax in fp32 over ``scale * q.k``; output in q's dtype.

The paged form reads the same positions from a pool of blocks through a block table: row b's position t is
``pool[block_table[b, t // Sb], :, t % Sb]``; its spec gathers each row into the slot layout and applies the slot
spec.

Legend (docs/conventions.md): B rows (= slots 0..B-1), N query heads, Nkv kv heads, G = N / Nkv, Dh head
dim, Bc cache slots (>= B), Tc cache length per slot, Nb pool blocks, Sb positions per block, Mb table entries per
row; local letters of this file: Tb = ``max_len`` (the positions read), Mr = ceil(Tb / Sb) (the blocks read).
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


def paged_decode_attention_reference(
    q_BNDh: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """o [B, N, Dh] in q's dtype, as ``decode_attention_reference`` on the slot layout the table describes.
    ``k/v_pool`` [Nb, Nkv, Sb, Dh] (any strides), ``block_table`` int [Bc, Mb] (Bc >= B, Mb * Sb >= ``max_len``):
    row b's position t is ``pool[block_table[b, t // Sb], :, t % Sb]``. Rows may share blocks. Only the entries of
    row b's first ceil(min(lens_B[b], max_len) / Sb) blocks are read; they must be in [0, Nb)."""
    B = q_BNDh.shape[0]
    _, Nkv, Sb, Dh = k_pool.shape
    Mr = -(-max_len // Sb)
    live_BMr = torch.arange(Mr, device=block_table.device)[None, :] * Sb < lens_B[:, None].clamp(max=max_len)
    # an entry past the row's length may hold anything: block 0 is gathered in its place, then zeroed
    blocks_BMr = torch.where(live_BMr, block_table[:B, :Mr].long(), 0)

    def to_slots(pool_NbNkvSbDh: torch.Tensor) -> torch.Tensor:  # [B, Nkv, Mr * Sb, Dh], a copy
        x_BMrNkvSbDh = pool_NbNkvSbDh[blocks_BMr].masked_fill(~live_BMr[:, :, None, None, None], 0)
        return x_BMrNkvSbDh.transpose(1, 2).reshape(B, Nkv, Mr * Sb, Dh)

    return decode_attention_reference(q_BNDh, to_slots(k_pool), to_slots(v_pool), lens_B, max_len, scale)
