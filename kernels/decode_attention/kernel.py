"""Triton decode attention (flash-decoding) and its launcher.

``split`` kernel: one program per (length split, row, kv head). It loads the G query heads of the
kv head's group once (padded to BLOCK_G rows, so ``tl.dot`` has 16 rows) and streams the split's
K/V positions [start, min(start + SPLIT_LEN, len)) in BLOCK_TC tiles with an online softmax (exp2,
log2(e) folded into the scale). Programs whose split starts past the row's length load nothing,
so a row reads only its own positions, not the bucket's.
- one split (``num_splits == 1``): it normalizes and writes o directly;
- several: it writes the unnormalized fp32 accumulator and (max, sum) per split, and the
  ``reduce`` kernel (one program per row and kv head) combines the row's non-empty splits.

Nothing reads the lengths on the host: they are loaded by the kernels, so a launch is CUDA-graph
capturable (its grid depends only on B, Nkv and ``max_len``).

Two K/V layouts, picked by the constexpr ``SB`` of the split kernel (the reduce kernel is shared):
- ``SB == 0``, slot cache [Bc, Nkv, Tc, Dh]: row b reads slot b (``decode_attention``);
- ``SB > 0``, paged pool [Nb, Nkv, Sb, Dh] with Sb = ``SB`` and a block table int32 [Bc, Mb]: row b's position t
  is in block ``table[b, t // Sb]`` at in-block position ``t % Sb`` (``paged_decode_attention``). Each tile loads
  the block id of each of its positions (BLOCK_TC int32 beside the tile's K/V), so any Sb works, also one that does
  not divide the tile. The slot launch passes the table pointer as None and its stride as 1, which Triton turns
  into constexprs: the slot kernel's parameters and code are those it had before the paged form existed.

FP8 K/V (constexpr ``KV_FP8``; slot and paged forms, not the fused one): k/v are float8 e4m3 with fp32 scales per
(position, kv head) at ``ks_ptr``/``vs_ptr`` (the cache's layout without Dh; strides ``ss_*``). A tile's k and v
are converted to q's dtype (exact: e4m3 fits in bf16/fp16/fp32), the scores ``q . k`` (fp32 accumulation) multiplied
by each position's k scale, and the probabilities by each position's v scale before ``p @ v`` (the softmax sum
uses the unscaled ones). Without FP8 the scale pointers are None and their strides 1: constexprs, so the model-dtype
kernels compile as before.

Interpreter (CPU, TRITON_INTERPRET=1): K/V/q tiles are upcast to fp32 before ``tl.dot`` (bf16
dots give garbage there); fp32 inputs use IEEE fp32 dots on GPU too (no TF32).

Legend: see reference.py (B rows, N query heads, Nkv kv heads, G = N / Nkv, Dh head dim, Bc cache slots, Tc cache
length, Nb pool blocks, Sb positions per block, Mb table entries per row). Kernel constexprs spell them NKV, G, DH,
SB; BLOCK_G / BLOCK_DH / BLOCK_TC tile G, Dh and positions.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from prime_spmd.kernels.counters import zeroed_counters
from prime_spmd.kernels.pdl import launch as pdl
from prime_spmd.kernels.pdl.launch import pdl_enter

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634


@triton.jit
def _norm_rope(row_ptr, cols, mask2, w_ptr, cos_ptr, sin_ptr, eps, DH: tl.constexpr, BLOCK_DH: tl.constexpr,
               QK_NORM: tl.constexpr):  # fmt: skip
    """Heads starting at columns ``cols`` [R] of one qkv row: RMSNorm over Dh (weight ``w_ptr``; QK_NORM), then RoPE
    (``cos_ptr``/``sin_ptr``: the row's position's Dh values; rotate-half through permuted columns); fp32 [R,
    BLOCK_DH]. Loads its tables itself, so nothing of it stays live through the caller's K/V loop."""
    offs_d = tl.arange(0, BLOCK_DH)
    mask_d = offs_d < DH
    offs_r = tl.where(offs_d < DH // 2, offs_d + DH // 2, offs_d - DH // 2)  # rotate-half's source column
    sign = tl.where(offs_d < DH // 2, -1.0, 1.0)
    cs = tl.load(cos_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    x = tl.load(row_ptr + cols[:, None] + offs_d[None, :], mask=mask2, other=0.0).to(tl.float32)
    xr = tl.load(row_ptr + cols[:, None] + offs_r[None, :], mask=mask2, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / DH + eps)
        w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        wr = tl.load(w_ptr + offs_r, mask=mask_d, other=0.0).to(tl.float32)
        x = x * rstd[:, None] * w[None, :]
        xr = xr * rstd[:, None] * wr[None, :]
    return x * cs[None, :] + sign[None, :] * xr * sn[None, :]


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, o_ptr, acc_ptr, ml_ptr,
    sq_b, sq_n, sk_bc, sk_nkv, sk_tc, sv_bc, sv_nkv, sv_tc, so_b, so_n,
    max_len, qk_scale, table_ptr, st_b,
    qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, s_cs, eps, cnt_ptr,
    ks_ptr, vs_ptr, ss_bc, ss_nkv, ss_tc,
    NKV: tl.constexpr, G: tl.constexpr, DH: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_TC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    SB: tl.constexpr, FUSE: tl.constexpr, QK_NORM: tl.constexpr, USE_PDL: tl.constexpr,
    PRELOAD_TILE: tl.constexpr = False, KV_FP8: tl.constexpr = False,
):  # fmt: skip
    """Program (length split, row x kv head) of the split kernel (the module docstring)."""
    pdl_enter(USE_PDL)  # kernels/pdl (the fused form only): a no-op unless launched with programmatic dependent launch
    pid_s = tl.program_id(0)
    pid_bnkv = tl.program_id(1)
    b = pid_bnkv // NKV
    kv = pid_bnkv % NKV
    length = tl.minimum(tl.load(lens_ptr + b).to(tl.int32), max_len)
    start = pid_s * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, length)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_DH)
    mask_g = offs_g < G
    mask_d = offs_d < DH
    heads = kv * G + offs_g
    if PRELOAD_TILE:  # (fused, slot cache, one tile a split: PRELOAD_TILE) the split's K/V tile, issued first; the
        # new token's entry, stale here, is substituted in the loop below, so no barrier orders this load after its write
        offs_p = start + tl.arange(0, BLOCK_TC)
        tile_mask = (offs_p < max_len)[:, None] & mask_d[None, :]
        k_tile = tl.load(k_ptr + b.to(tl.int64) * sk_bc + kv * sk_nkv + offs_p[:, None] * sk_tc + offs_d[None, :],
                         mask=tile_mask, other=0.0)  # fmt: skip
        v_tile = tl.load(v_ptr + b.to(tl.int64) * sv_bc + kv * sv_nkv + offs_p[:, None] * sv_tc + offs_d[None, :],
                         mask=tile_mask, other=0.0)  # fmt: skip
    if FUSE:  # q_ptr is the QKV projection [B, (N + 2 Nkv) Dh]: q/k norm, RoPE and the cache write happen here
        qkv_row = q_ptr + b.to(tl.int64) * sq_b
        cos_row, sin_row = cos_ptr + b * s_cs, sin_ptr + b * s_cs
        gd = mask_g[:, None] & mask_d[None, :]
        q = _norm_rope(qkv_row, heads * DH, gd, qn_ptr, cos_row, sin_row, eps, DH, BLOCK_DH, QK_NORM)
        q = q.to(k_ptr.dtype.element_ty)
        # the new token: every program of the row's kv head computes its k, v (cheap, from the QKV row); the one whose
        # split holds pos writes them to the cache, and the barrier makes the write visible to its threads' loads of
        # the tile that holds pos (no other program reads pos). The loop below is then the unfused kernel's: keeping
        # k/v live through it to substitute them in their tile took 166 registers and 70 KB of shared memory at
        # sm_90 (unfused: 85 and 39 KB), 3 programs per SM instead of 5
        k1 = _norm_rope(qkv_row, (NKV * G + kv) * DH + tl.arange(0, 1), mask_d[None, :], kn_ptr, cos_row, sin_row, eps,
                        DH, BLOCK_DH, QK_NORM)  # fmt: skip
        k_new = tl.sum(k1, 0).to(k_ptr.dtype.element_ty)  # [BLOCK_DH]
        v_new = tl.load(qkv_row + (NKV * G + NKV + kv) * DH + offs_d, mask=mask_d, other=0.0).to(v_ptr.dtype.element_ty)
        pos = tl.load(pos_ptr + b).to(tl.int32)
        pos_d = offs_d * 0 + pos  # the write mask as a vector (a scalar term gives the interpreter a bad mask)
        writes = mask_d & (pos_d >= start) & (pos_d < end)
        if SB == 0:
            k_at = k_ptr + b.to(tl.int64) * sk_bc + kv * sk_nkv + pos * sk_tc
            v_at = v_ptr + b.to(tl.int64) * sv_bc + kv * sv_nkv + pos * sv_tc
        else:
            pos_in = tl.minimum(tl.maximum(pos, 0), max_len - 1)  # a row that writes nothing reads no stray entry
            blk_new = tl.load(table_ptr + b.to(tl.int64) * st_b + pos_in // SB).to(tl.int64)
            k_at = k_ptr + blk_new * sk_bc + kv * sk_nkv + (pos % SB) * sk_tc
            v_at = v_ptr + blk_new * sv_bc + kv * sv_nkv + (pos % SB) * sv_tc
        tl.store(k_at + offs_d, k_new, mask=writes)
        tl.store(v_at + offs_d, v_new, mask=writes)
        if not PRELOAD_TILE:
            tl.debug_barrier()
    else:
        q = tl.load(
            q_ptr + b * sq_b + heads[:, None] * sq_n + offs_d[None, :], mask=mask_g[:, None] & mask_d[None, :],
            other=0.0,
        )  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DH], tl.float32)
    if SB == 0:
        k_base = k_ptr + b.to(tl.int64) * sk_bc + kv * sk_nkv
        v_base = v_ptr + b.to(tl.int64) * sv_bc + kv * sv_nkv
        if KV_FP8:
            s_base = b.to(tl.int64) * ss_bc + kv * ss_nkv
    else:  # pool: sk_bc / sv_bc step blocks, sk_tc / sv_tc positions in a block
        k_base = k_ptr + kv * sk_nkv
        v_base = v_ptr + kv * sv_nkv
        table_row = table_ptr + b.to(tl.int64) * st_b
    for t0 in range(start, end, BLOCK_TC):
        offs_t = t0 + tl.arange(0, BLOCK_TC)
        mask_t = offs_t < end
        kv_mask = mask_t[:, None] & mask_d[None, :]
        if PRELOAD_TILE:  # one pass (SPLIT_LEN == BLOCK_TC): the preloaded tile, this launch's k / v at pos
            new_row = (offs_t == pos)[:, None]
            k = tl.where(new_row, k_new[None, :], k_tile)
            v = tl.where(new_row, v_new[None, :], v_tile)
        elif SB == 0:
            k = tl.load(k_base + offs_t[:, None] * sk_tc + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + offs_t[:, None] * sv_tc + offs_d[None, :], mask=kv_mask, other=0.0)
        else:
            blk = tl.load(table_row + offs_t // SB, mask=mask_t, other=0).to(tl.int64)  # [BLOCK_TC]
            in_blk = offs_t % SB
            k_rows = blk * sk_bc + in_blk * sk_tc
            v_rows = blk * sv_bc + in_blk * sv_tc
            k = tl.load(k_base + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:  # the tile's per-position scales; e4m3 -> q's dtype is exact
            if SB == 0:
                s_rows = s_base + offs_t * ss_tc
            else:
                s_rows = blk * ss_bc + in_blk * ss_tc + kv * ss_nkv
            k_sc = tl.load(ks_ptr + s_rows, mask=mask_t, other=0.0)
            v_sc = tl.load(vs_ptr + s_rows, mask=mask_t, other=0.0)
            k, v = k.to(q.dtype), v.to(q.dtype)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if KV_FP8:
            s = s * k_sc[None, :]
        s = tl.where(mask_t[None, :], s * qk_scale, float("-inf"))  # [BLOCK_G, BLOCK_TC], log2 units
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        s_sum = s_sum * alpha + tl.sum(p, 1)
        if KV_FP8:  # v's scale moves onto p (constant along Dh), after the softmax sum took p
            p = p * v_sc[None, :]
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new

    gd_mask = mask_g[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        o = acc / s_sum[:, None]
        tl.store(o_ptr + b * so_b + heads[:, None] * so_n + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=gd_mask)
    else:
        # scratch [B, Nkv, NUM_SPLITS, G, Dh] and [B, Nkv, NUM_SPLITS, G, 2]; empty splits are never read
        row = (pid_bnkv * NUM_SPLITS + pid_s) * G
        tl.store(acc_ptr + (row + offs_g[:, None]) * DH + offs_d[None, :], acc, mask=gd_mask)
        tl.store(ml_ptr + (row + offs_g) * 2, m, mask=mask_g)
        tl.store(ml_ptr + (row + offs_g) * 2 + 1, s_sum, mask=mask_g)
        if FUSE:  # the last split of the (row, kv head) to finish combines them: no reduce launch
            last = tl.atomic_add(cnt_ptr + pid_bnkv, 1) == NUM_SPLITS - 1  # acq_rel: the others' partials visible
            if last:
                _combine_splits(acc_ptr, ml_ptr, o_ptr, so_b, so_n, pid_bnkv, length, NKV, G, DH, NUM_SPLITS,
                                SPLIT_LEN, BLOCK_G, BLOCK_DH)  # fmt: skip
                tl.store(cnt_ptr + pid_bnkv, 0)  # left zeroed for the next launch (and CUDA-graph replays)


@triton.jit
def _reduce_kernel(
    acc_ptr, ml_ptr, lens_ptr, o_ptr, so_b, so_n, max_len,
    NKV: tl.constexpr, G: tl.constexpr, DH: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_DH: tl.constexpr,
):  # fmt: skip
    pid_bnkv = tl.program_id(0)
    length = tl.minimum(tl.load(lens_ptr + pid_bnkv // NKV).to(tl.int32), max_len)
    _combine_splits(acc_ptr, ml_ptr, o_ptr, so_b, so_n, pid_bnkv, length, NKV, G, DH, NUM_SPLITS, SPLIT_LEN, BLOCK_G,
                    BLOCK_DH)  # fmt: skip


@triton.jit
def _combine_splits(
    acc_ptr, ml_ptr, o_ptr, so_b, so_n, pid_bnkv, length,
    NKV: tl.constexpr, G: tl.constexpr, DH: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_DH: tl.constexpr,
):  # fmt: skip
    """o of one (row, kv head) from its live splits' partials (in split order)."""
    b = pid_bnkv // NKV
    kv = pid_bnkv % NKV
    num_live = tl.cdiv(length, SPLIT_LEN)  # splits that saw at least one position
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_DH)
    mask_g = offs_g < G
    gd_mask = mask_g[:, None] & (offs_d[None, :] < DH)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DH], tl.float32)
    for s in range(0, num_live):
        row = (pid_bnkv * NUM_SPLITS + s) * G
        m_s = tl.load(ml_ptr + (row + offs_g) * 2, mask=mask_g, other=0.0)
        l_s = tl.load(ml_ptr + (row + offs_g) * 2 + 1, mask=mask_g, other=1.0)  # padded rows: no 0/0
        a_s = tl.load(acc_ptr + (row + offs_g[:, None]) * DH + offs_d[None, :], mask=gd_mask, other=0.0)
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_s - m_new)
        s_sum = s_sum * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m = m_new
    heads = kv * G + offs_g
    o = acc / s_sum[:, None]
    tl.store(o_ptr + b * so_b + heads[:, None] * so_n + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=gd_mask)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_block_tc(head_dim: int) -> int:
    """Positions per K/V tile: 16 under the interpreter (so tests have ragged tiles), else 64 (128 for Dh <= 64)."""
    if INTERPRET:
        return 16
    return 128 if head_dim <= 64 else 64


# GPU: each split spans at least this many K/V tiles: H200, batch 1, PDL + fused prefill: 1,378 tok/s at 1 vs 1,258 at
# 2 (docs/benchmarks.md)
SPLIT_TILES = 1


# Fused form, slot cache, one tile a split (batch 1 at short lengths): load the split's K/V tile first and substitute
# the new token's k / v in registers, instead of writing them, a CTA barrier, then loading the tile. H200, batch 1
# with PDL + fused prefill: 1,378 vs 1,345 tok/s (docs/benchmarks.md).
PRELOAD_TILE = True


def pick_num_splits(batch: int, num_kv_heads: int, max_len: int, device: torch.device, bn: int) -> int:
    """Length splits per (row, kv head): enough programs for ~2 per SM, each split at least ``SPLIT_TILES`` tiles
    (one by default). Host-only arithmetic on static sizes (no sync). CPU/interpreter: one split per 4 tiles."""
    tiles = triton.cdiv(max_len, bn)
    if device.type != "cuda":
        return max(1, triton.cdiv(tiles, 4))
    want = triton.cdiv(2 * _num_sms(device.index or 0), batch * num_kv_heads)
    return max(1, min(tiles // SPLIT_TILES, want))


def decode_attention(
    q_BNDh: torch.Tensor,
    k_BcNkvTcDh: torch.Tensor,
    v_BcNkvTcDh: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    num_splits: int = 0,
    num_warps: int = 4,
    num_stages: int = 2,
    tile: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """o [B, N, Dh] like q (see reference.py); ``num_splits`` 0 picks by shape (``pick_num_splits``),
    ``tile`` 0 by ``default_block_tc`` (benchmarks/decode_attention.py sweeps tile, warps and stages).
    q, k, v: the same float dtype (or float8 e4m3 k, v with fp32 ``k_scale``/``v_scale`` [Bc, Nkv, Tc] of one
    stride), last dim contiguous; lens_B int32/int64 on the same device."""
    if q_BNDh.stride(-1) != 1 or k_BcNkvTcDh.stride(-1) != 1 or v_BcNkvTcDh.stride(-1) != 1:
        raise ValueError(
            f"decode_attention: the head dim must be contiguous (strides q {q_BNDh.stride()}, "
            f"k {k_BcNkvTcDh.stride()}, v {v_BcNkvTcDh.stride()})"
        )
    # table None and stride 1 specialize to constexprs: the slot kernel's parameter list has no table
    return _launch(q_BNDh, q_BNDh.shape, q_BNDh.stride()[:2], k_BcNkvTcDh, v_BcNkvTcDh, lens_B, max_len, scale,
                   num_splits, num_warps, num_stages, tile, None, 1, 0, None, k_scale, v_scale)  # fmt: skip


def paged_decode_attention(
    q_BNDh: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    num_splits: int = 0,
    num_warps: int = 4,
    num_stages: int = 2,
    tile: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``decode_attention`` over a paged cache: ``k/v_pool`` [Nb, Nkv, Sb, Dh] (any strides, head dim contiguous),
    ``block_table`` int32 [Bc, Mb] (last dim contiguous) on q's device; row b's position t is
    ``pool[block_table[b, t // Sb], :, t % Sb]`` (see reference.py). Only the entries of a row's first
    ceil(min(lens_B[b], max_len) / Sb) blocks are read; every one of them must be a block id in [0, Nb)
    (not checked: that would sync). o [B, N, Dh] like q; the other arguments as ``decode_attention``."""
    if q_BNDh.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError(
            f"paged_decode_attention: the head dim and the table's last dim must be contiguous (strides q "
            f"{q_BNDh.stride()}, k_pool {k_pool.stride()}, v_pool {v_pool.stride()}, block_table {block_table.stride()})"
        )
    return _launch(q_BNDh, q_BNDh.shape, q_BNDh.stride()[:2], k_pool, v_pool, lens_B, max_len, scale, num_splits,
                   num_warps, num_stages, tile, block_table, block_table.stride(0), k_pool.shape[2], None, k_scale,
                   v_scale)  # fmt: skip


def fused_decode_attention(
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
    num_splits: int = 0,
    num_warps: int = 4,
    num_stages: int = 2,
    tile: int = 0,
) -> torch.Tensor:
    """Decode attention from the QKV projection: q/k RMSNorm (``q_norm_w``/``k_norm_w``, both or neither), RoPE
    (``cos/sin_BDh`` at ``pos_B``), the new token's k/v written at ``pos_B[b]`` of row b's cache (slot layout with
    ``block_table`` None, else paged), then attention over positions [0, min(lens_B[b], max_len)), which must
    include pos_B[b] for a row whose new token is to be written (lens_B = pos_B + 1, as the engine passes it).
    ``qkv_BP`` [B, (N + 2 Nkv) Dh] (P: the packed q|k|v columns), head dim contiguous. o [B, N, Dh]; mutates the
    caches (see reference.fused_decode_attention_reference). Shapes are checked by op.check_fused_inputs."""
    if qkv_BP.stride(-1) != 1 or cos_BDh.stride() != sin_BDh.stride() or cos_BDh.stride(-1) != 1:
        raise ValueError(
            f"fused_decode_attention: qkv's columns must be contiguous (stride {qkv_BP.stride()}) and cos/sin share "
            f"one stride with a contiguous last dim (the kernel reads both with cos's; strides {cos_BDh.stride()}, "
            f"{sin_BDh.stride()})"
        )
    B, Dh = qkv_BP.shape[0], k_cache.shape[3]
    fused = dict(
        qn_ptr=q_norm_w, kn_ptr=k_norm_w, cos_ptr=cos_BDh, sin_ptr=sin_BDh, pos_ptr=pos_B, s_cs=cos_BDh.stride(0),
        eps=eps, FUSE=True, QK_NORM=q_norm_w is not None,
    )  # fmt: skip
    sb = 0 if block_table is None else k_cache.shape[2]
    st_b = 1 if block_table is None else block_table.stride(0)
    return _launch(qkv_BP, (B, num_heads, Dh), (qkv_BP.stride(0), Dh), k_cache, v_cache, lens_B, max_len, scale,
                   num_splits, num_warps, num_stages, tile, block_table, st_b, sb, fused)  # fmt: skip


UNFUSED = dict(qn_ptr=None, kn_ptr=None, cos_ptr=None, sin_ptr=None, pos_ptr=None, s_cs=None, eps=None, cnt_ptr=None,
               FUSE=False, QK_NORM=False, USE_PDL=False, PRELOAD_TILE=False)  # fmt: skip
"""The fused form's arguments when it is off: None constexprs, so the unfused kernels compile as they did."""
NO_FP8 = dict(ks_ptr=None, vs_ptr=None, KV_FP8=False)
"""FP8 K/V's arguments when the cache is in the model dtype: None constexprs."""


def _launch(q, q_shape, q_strides, k, v, lens_B, max_len, scale, num_splits, num_warps, num_stages, tile, table, st_b,
            sb, fused, k_scale=None, v_scale=None):  # fmt: skip
    """The split kernel (and the reduce kernel for several splits); k/v a slot cache (``sb`` 0, ``table`` None)
    or a pool of blocks of ``sb`` positions (dims: [Bc or Nb, Nkv, Tc or Sb, Dh]); ``q`` [B, N, Dh] (``q_shape``,
    row and head strides ``q_strides``) or, with ``fused``, the QKV projection."""
    B, N, Dh = q_shape
    Nkv = k.shape[1]
    G = N // Nkv
    block_tc = tile or default_block_tc(Dh)
    if num_splits <= 0:
        num_splits = pick_num_splits(B, Nkv, max_len, q.device, block_tc)
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), block_tc) * block_tc  # a multiple of the tile
    num_splits = triton.cdiv(max_len, split_len)
    o_BNDh = torch.empty(B, N, Dh, device=q.device, dtype=q.dtype)
    if num_splits > 1:
        acc = torch.empty(B, Nkv, num_splits, G, Dh, device=q.device, dtype=torch.float32)
        ml = torch.empty(B, Nkv, num_splits, G, 2, device=q.device, dtype=torch.float32)
    else:
        acc = ml = o_BNDh  # unused
    meta = dict(
        NKV=Nkv,
        G=G,
        DH=Dh,
        NUM_SPLITS=num_splits,
        SPLIT_LEN=split_len,
        BLOCK_G=max(16, triton.next_power_of_2(G)),
        BLOCK_DH=max(16, triton.next_power_of_2(Dh)),
    )
    if fused is not None:  # the split kernel combines the splits itself (an atomic counter per row and kv head)
        fused = {**fused, "cnt_ptr": zeroed_counters(q.device, B * Nkv, "decode_attention"), "USE_PDL": pdl.enabled()}
        fused["PRELOAD_TILE"] = PRELOAD_TILE and sb == 0 and split_len == block_tc
    assert (k_scale is None) == (k.dtype != torch.float8_e4m3fn) and not (fused and k_scale is not None)
    # scales None with strides 1 (constexprs) leave the model-dtype kernels as they were
    fp8 = {} if k_scale is None else dict(ks_ptr=k_scale, vs_ptr=v_scale, KV_FP8=True)
    ss = (1, 1, 1) if k_scale is None else k_scale.stride()
    _split_kernel[(num_splits, B * Nkv)](
        q, k, v, lens_B, o_BNDh, acc, ml,
        q_strides[0], q_strides[1],
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o_BNDh.stride(0), o_BNDh.stride(1),
        max_len, scale * LOG2E, table, st_b,
        ss_bc=ss[0], ss_nkv=ss[1], ss_tc=ss[2],
        BLOCK_TC=block_tc, UPCAST=INTERPRET, IEEE=q.dtype == torch.float32 and not INTERPRET, SB=sb,
        num_warps=num_warps, num_stages=num_stages, **meta, **(fused or UNFUSED), **(fp8 or NO_FP8),
        **(pdl.launch_options() if fused else {}),
    )  # fmt: skip
    if num_splits > 1 and fused is None:
        _reduce_kernel[(B * Nkv,)](
            acc, ml, lens_B, o_BNDh, o_BNDh.stride(0), o_BNDh.stride(1), max_len, num_warps=4, **meta
        )
    return o_BNDh
