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


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama/Qwen RMSNorm: fp32 statistics, cast back, then scale by ``w``."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x_BHDh: torch.Tensor, cos_BDh: torch.Tensor, sin_BDh: torch.Tensor) -> torch.Tensor:
    half = x_BHDh.shape[-1] // 2
    rotated = torch.cat((-x_BHDh[..., half:], x_BHDh[..., :half]), dim=-1)
    return x_BHDh * cos_BDh[:, None] + rotated * sin_BDh[:, None]


def fused_decode_attention_reference(
    qkv_BP: torch.Tensor,
    num_heads: int,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    cos_BDh: torch.Tensor,
    sin_BDh: torch.Tensor,
    pos_B: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    eps: float,
) -> torch.Tensor:
    """The decode layer's attention from its QKV projection ``qkv_BP`` [B, (N + 2 Nkv) Dh] (local letter P: the
    packed q | k | v columns, N = ``num_heads``): q and k get RMSNorm (``q_norm_w``, ``k_norm_w`` [Dh]; both None:
    none, e.g. Llama) then RoPE (rotate-half, ``cos/sin_BDh`` the tables' rows at ``pos_B``); row b's new k and v
    are written at position ``pos_B[b]`` of its cache when that position is one it attends (0 <= pos_B[b] <
    min(lens_B[b], max_len)); then attention as ``decode_attention_reference`` (slot cache [Bc, Nkv, Tc, Dh],
    ``block_table`` None) or ``paged_decode_attention_reference`` (pool [Nb, Nkv, Sb, Dh] and its table). Returns
    o [B, N, Dh] in qkv's dtype; mutates ``k_cache`` and ``v_cache``."""
    B = qkv_BP.shape[0]
    Nkv, Dh = k_cache.shape[1], k_cache.shape[3]
    nq, nk = num_heads * Dh, Nkv * Dh
    q = qkv_BP[:, :nq].reshape(B, num_heads, Dh)
    k = qkv_BP[:, nq : nq + nk].reshape(B, Nkv, Dh)
    v = qkv_BP[:, nq + nk :].reshape(B, Nkv, Dh)
    if q_norm_w is not None:
        q, k = _rms_norm(q, q_norm_w, eps), _rms_norm(k, k_norm_w, eps)
    q, k = _rope(q, cos_BDh, sin_BDh), _rope(k, cos_BDh, sin_BDh)
    for b in torch.nonzero((pos_B >= 0) & (pos_B < lens_B.clamp(max=max_len))).flatten().tolist():
        p = int(pos_B[b])
        if block_table is None:
            k_cache[b, :, p], v_cache[b, :, p] = k[b], v[b]
        else:
            blk = int(block_table[b, p // k_cache.shape[2]])
            k_cache[blk, :, p % k_cache.shape[2]], v_cache[blk, :, p % k_cache.shape[2]] = k[b], v[b]
    if block_table is None:
        return decode_attention_reference(q, k_cache, v_cache, lens_B, max_len, scale)
    return paged_decode_attention_reference(q, k_cache, v_cache, block_table, lens_B, max_len, scale)
