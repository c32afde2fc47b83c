"""Decode attention, the spec: one new query token per row against that row's cached K/V.

Row b's query heads attend positions [0, min(lens_B[b], max_len)) of cache slot b; query head n
reads kv head n // G (GQA, G = N / Nkv). Softmax in fp32 over ``scale * q.k``; output in q's dtype.

The paged form reads the same positions from a pool of blocks through a block table: row b's position t is
``pool[block_table[b, t // Sb], :, t % Sb]``; its spec gathers each row into the slot layout and applies the slot
spec.

FP8 KV (``--inference.kv_cache_dtype fp8``): K and V are float8 e4m3 with one fp32 scale per (position, kv head),
the amax of that position's Dh values over 448 (``quantize_kv``: kernels/fp8/reference.py's rounding, each (position,
kv head) a row); the scales ``k/v_scale`` have the cache's shape without Dh. Attention reads ``k * k_scale`` and
``v * v_scale`` (``dequantize_kv``); the rest of the spec is unchanged.

Legend (docs/conventions.md): B rows (= slots 0..B-1), N query heads, Nkv kv heads, G = N / Nkv, Dh head
dim, Bc cache slots (>= B), Tc cache length per slot, Nb pool blocks, Sb positions per block, Mb table entries per
row; local letters of this file: Tb = ``max_len`` (the positions read), Mr = ceil(Tb / Sb) (the blocks read).
"""

from __future__ import annotations

import torch
from prime_spmd.kernels.fp8.reference import FP8_DTYPE, quantize_fp8_reference


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8 float8_e4m3fn, scale fp32) of K or V ``x`` [..., Dh]: one scale per leading index (a position of a kv
    head), amax(|x|) / 448 over its Dh values (AMAX_FLOOR for a zero vector), x8 = round(x / scale). Why per
    (position, kv head): the kernel multiplies a tile's scores (and its probabilities, for V) by one scale per
    position, no rescale inside the Dh dot; a token's scale is set once when it is written, never revised (a
    per-block scale would change as the block fills, re-quantizing what is stored); 4 bytes beside Dh."""
    x8, scale = quantize_fp8_reference(x.reshape(-1, x.shape[-1]))
    return x8.view(x.shape), scale.view(x.shape[:-1])


def dequantize_kv(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x8 * scale`` [..., Dh] in ``dtype`` (one rounding from fp32); ``scale`` [...] (``quantize_kv``)."""
    return (x8.float() * scale.float()[..., None]).to(dtype)


def _kv_float(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """K or V in fp32: dequantized with ``scale`` when fp8, else upcast."""
    assert (x.dtype == FP8_DTYPE) == (scale is not None), "fp8 K/V come with their scales, others without"
    return x.float() if scale is None else dequantize_kv(x, scale, torch.float32)


def decode_attention_reference(
    q_BNDh: torch.Tensor,
    k_BcNkvTcDh: torch.Tensor,
    v_BcNkvTcDh: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """o [B, N, Dh] in q's dtype. ``k/v_BcNkvTcDh`` [Bc, Nkv, Tc, Dh] (any strides), ``lens_B`` int [B], each
    >= 1 (a row of length 0 gives NaN); lengths above ``max_len`` (<= Tc) are clamped to it. FP8 K/V come with
    ``k_scale``/``v_scale`` fp32 [Bc, Nkv, Tc] (``quantize_kv``)."""
    B, N, Dh = q_BNDh.shape
    Nkv = k_BcNkvTcDh.shape[1]
    ks = None if k_scale is None else k_scale[:B, :, :max_len]
    vs = None if v_scale is None else v_scale[:B, :, :max_len]
    k_BNkvTbDh = _kv_float(k_BcNkvTcDh[:B, :, :max_len], ks)
    v_BNkvTbDh = _kv_float(v_BcNkvTcDh[:B, :, :max_len], vs)
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """o [B, N, Dh] in q's dtype, as ``decode_attention_reference`` on the slot layout the table describes.
    ``k/v_pool`` [Nb, Nkv, Sb, Dh] (any strides), ``block_table`` int [Bc, Mb] (Bc >= B, Mb * Sb >= ``max_len``):
    row b's position t is ``pool[block_table[b, t // Sb], :, t % Sb]``. Rows may share blocks. Only the entries of
    row b's first ceil(min(lens_B[b], max_len) / Sb) blocks are read; they must be in [0, Nb). FP8 pools come with
    ``k_scale``/``v_scale`` fp32 [Nb, Nkv, Sb]."""
    B = q_BNDh.shape[0]
    _, Nkv, Sb, Dh = k_pool.shape
    Mr = -(-max_len // Sb)
    live_BMr = torch.arange(Mr, device=block_table.device)[None, :] * Sb < lens_B[:, None].clamp(max=max_len)
    # an entry past the row's length may hold anything: block 0 is gathered in its place, then zeroed
    blocks_BMr = torch.where(live_BMr, block_table[:B, :Mr].long(), 0)

    def to_slots(pool: torch.Tensor | None) -> torch.Tensor | None:  # [B, Nkv, Mr * Sb, (Dh)], a copy
        if pool is None:
            return None
        x = pool[blocks_BMr]  # [B, Mr, Nkv, Sb, (Dh)]
        dead = ~live_BMr.view(B, Mr, *[1] * (x.ndim - 2))
        if x.dtype == FP8_DTYPE:  # masked_fill has no float8 kernel (torch 2.13); 0x00 is +0.0 in e4m3
            x = x.view(torch.uint8).masked_fill(dead, 0).view(FP8_DTYPE)
        else:
            x = x.masked_fill(dead, 0)
        return x.transpose(1, 2).reshape(B, Nkv, Mr * Sb, *x.shape[4:])

    return decode_attention_reference(q_BNDh, to_slots(k_pool), to_slots(v_pool), lens_B, max_len, scale,
                                      to_slots(k_scale), to_slots(v_scale))  # fmt: skip


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
