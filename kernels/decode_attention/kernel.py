"""Triton decode attention (flash-decoding) and its launcher.

``split`` kernel: one program per (length split, row, kv head). It loads the G query heads of the
kv head's group once (padded to BLOCK_G rows, so ``tl.dot`` has 16 rows) and streams the split's
K/V positions [start, min(start + SPLIT_LEN, len)) in BLOCK_N tiles with an online softmax (exp2,
log2(e) folded into the scale). Programs whose split starts past the row's length load nothing,
so a row reads only its own positions, not the bucket's.
- one split (``num_splits == 1``): it normalizes and writes o directly;
- several: it writes the unnormalized fp32 accumulator and (max, sum) per split, and the
  ``reduce`` kernel (one program per row and kv head) combines the row's non-empty splits.

Nothing reads the lengths on the host: they are loaded by the kernels, so a launch is CUDA-graph
capturable (its grid depends only on B, J and ``max_len``).

Interpreter (CPU, TRITON_INTERPRET=1): K/V/q tiles are upcast to fp32 before ``tl.dot`` (bf16
dots give garbage there); fp32 inputs use IEEE fp32 dots on GPU too (no TF32).

Legend: see reference.py (B rows, H query heads, J kv heads, G = H / J, D head dim, L cache length).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, o_ptr, acc_ptr, ml_ptr,
    sq_b, sq_h, sk_s, sk_j, sk_l, sv_s, sv_j, sv_l, so_b, so_h,
    max_len, qk_scale,
    J: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(0)
    pid_bj = tl.program_id(1)
    b = pid_bj // J
    j = pid_bj % J
    length = tl.minimum(tl.load(lens_ptr + b).to(tl.int32), max_len)
    start = pid_s * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, length)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < D
    heads = j * G + offs_g
    q = tl.load(
        q_ptr + b * sq_b + heads[:, None] * sq_h + offs_d[None, :], mask=mask_g[:, None] & mask_d[None, :], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_base = k_ptr + b.to(tl.int64) * sk_s + j * sk_j
    v_base = v_ptr + b.to(tl.int64) * sv_s + j * sv_j
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_base + offs_n[:, None] * sk_l + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * sv_l + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))  # [BLOCK_G, BLOCK_N], log2 units
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        s_sum = s_sum * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new

    gd_mask = mask_g[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        o = acc / s_sum[:, None]
        tl.store(o_ptr + b * so_b + heads[:, None] * so_h + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=gd_mask)
    else:
        # scratch [B, J, NUM_SPLITS, G, D] and [B, J, NUM_SPLITS, G, 2]; empty splits are never read
        row = (pid_bj * NUM_SPLITS + pid_s) * G
        tl.store(acc_ptr + (row + offs_g[:, None]) * D + offs_d[None, :], acc, mask=gd_mask)
        tl.store(ml_ptr + (row + offs_g) * 2, m, mask=mask_g)
        tl.store(ml_ptr + (row + offs_g) * 2 + 1, s_sum, mask=mask_g)


@triton.jit
def _reduce_kernel(
    acc_ptr, ml_ptr, lens_ptr, o_ptr, so_b, so_h, max_len,
    J: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_bj = tl.program_id(0)
    b = pid_bj // J
    j = pid_bj % J
    length = tl.minimum(tl.load(lens_ptr + b).to(tl.int32), max_len)
    num_live = tl.cdiv(length, SPLIT_LEN)  # splits that saw at least one position
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    gd_mask = mask_g[:, None] & (offs_d[None, :] < D)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in range(0, num_live):
        row = (pid_bj * NUM_SPLITS + s) * G
        m_s = tl.load(ml_ptr + (row + offs_g) * 2, mask=mask_g, other=0.0)
        l_s = tl.load(ml_ptr + (row + offs_g) * 2 + 1, mask=mask_g, other=1.0)  # padded rows: no 0/0
        a_s = tl.load(acc_ptr + (row + offs_g[:, None]) * D + offs_d[None, :], mask=gd_mask, other=0.0)
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_s - m_new)
        s_sum = s_sum * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m = m_new
    heads = j * G + offs_g
    o = acc / s_sum[:, None]
    tl.store(o_ptr + b * so_b + heads[:, None] * so_h + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=gd_mask)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def block_n(head_dim: int) -> int:
    """Positions per K/V tile: 16 under the interpreter (so tests have ragged tiles), else 64 (128 for D <= 64)."""
    if INTERPRET:
        return 16
    return 128 if head_dim <= 64 else 64


def pick_num_splits(batch: int, num_kv_heads: int, max_len: int, device: torch.device, bn: int) -> int:
    """Length splits per (row, kv head): enough programs for ~2 per SM, at most one tile per split.
    Host-only arithmetic on static sizes (no sync). CPU/interpreter: one split per 4 tiles."""
    tiles = triton.cdiv(max_len, bn)
    if device.type != "cuda":
        return max(1, triton.cdiv(tiles, 4))
    want = triton.cdiv(2 * _num_sms(device.index or 0), batch * num_kv_heads)
    return max(1, min(tiles, want))


def decode_attention(
    q_BHD: torch.Tensor,
    k_SJLD: torch.Tensor,
    v_SJLD: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    num_splits: int = 0,
    num_warps: int = 4,
    num_stages: int = 2,
    tile: int = 0,
) -> torch.Tensor:
    """o [B, H, D] like q (see reference.py); ``num_splits`` 0 picks by shape (``pick_num_splits``),
    ``tile`` 0 by ``block_n`` (benchmarks/decode_attention.py sweeps tile, warps and stages).
    q, k, v: the same float dtype, last dim contiguous; lens_B int32/int64 on the same device."""
    b, h, d = q_BHD.shape
    j = k_SJLD.shape[1]
    g = h // j
    if q_BHD.stride(-1) != 1 or k_SJLD.stride(-1) != 1 or v_SJLD.stride(-1) != 1:
        raise ValueError(
            f"decode_attention: the head dim must be contiguous (strides q {q_BHD.stride()}, k {k_SJLD.stride()}, "
            f"v {v_SJLD.stride()})"
        )
    bn = tile or block_n(d)
    if num_splits <= 0:
        num_splits = pick_num_splits(b, j, max_len, q_BHD.device, bn)
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), bn) * bn  # a multiple of the tile
    num_splits = triton.cdiv(max_len, split_len)
    o = torch.empty_like(q_BHD)
    if num_splits > 1:
        acc = torch.empty(b, j, num_splits, g, d, device=q_BHD.device, dtype=torch.float32)
        ml = torch.empty(b, j, num_splits, g, 2, device=q_BHD.device, dtype=torch.float32)
    else:
        acc = ml = o  # unused
    meta = dict(
        J=j,
        G=g,
        D=d,
        NUM_SPLITS=num_splits,
        SPLIT_LEN=split_len,
        BLOCK_G=max(16, triton.next_power_of_2(g)),
        BLOCK_D=max(16, triton.next_power_of_2(d)),
    )
    _split_kernel[(num_splits, b * j)](
        q_BHD, k_SJLD, v_SJLD, lens_B, o, acc, ml,
        q_BHD.stride(0), q_BHD.stride(1),
        k_SJLD.stride(0), k_SJLD.stride(1), k_SJLD.stride(2),
        v_SJLD.stride(0), v_SJLD.stride(1), v_SJLD.stride(2),
        o.stride(0), o.stride(1),
        max_len, scale * LOG2E,
        BLOCK_N=bn, UPCAST=INTERPRET, IEEE=q_BHD.dtype == torch.float32 and not INTERPRET,
        num_warps=num_warps, num_stages=num_stages, **meta,
    )  # fmt: skip
    if num_splits > 1:
        _reduce_kernel[(b * j,)](acc, ml, lens_B, o, o.stride(0), o.stride(1), max_len, num_warps=4, **meta)
    return o
