"""Triton fused decode linear (see reference.py for the math) and its launcher.

One program per (BLOCK_N output columns, BLOCK_M rows). With a norm it first reads its rows of x once
for the sum of squares (M x K elements: a few KB, from L2), then streams its slab of w in BLOCK_K
tiles, normalizing each x tile on the fly, and accumulates with ``tl.dot`` in fp32 (rows padded to
16, so the dot has its minimum shape; the padding costs compute only, and the kernel is bound by
reading w). "silu_mul" programs read two slabs, columns j of the gate half and of the up half, and
write silu(gate) * up; a residual is added in the epilogue. (Splitting K over programs lost to the one-row GEMV:
H200, Qwen3-0.6B, o / down at one row 4.74 / 5.77 us at the best split against 3.34 / 4.04; docs/benchmarks.md.)

Interpreter (CPU, TRITON_INTERPRET=1): tiles are upcast to fp32 before ``tl.dot`` (bf16 dots give garbage
there); fp32 inputs use IEEE fp32 dots on GPU too (no TF32).

Legend: see reference.py (M rows, K in, N out features of w, No output columns).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from prime_spmd.kernels.pdl import launch as pdl
from prime_spmd.kernels.pdl.launch import pdl_enter, prefetch_rows_l2

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _cast(v, DTYPE: tl.constexpr, RNE_EMU: tl.constexpr):
    """fp32 ``v`` to DTYPE, rounding to nearest even as torch does. RNE_EMU (bf16 under the interpreter,
    whose cast truncates): round in the fp32 bits (add 0x7FFF plus the kept lowest bit, drop 16 bits),
    so CPU tests see the GPU's rounding. Finite values only (the layer's are)."""
    if RNE_EMU:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True).to(DTYPE)
    return v.to(DTYPE)


@triton.jit
def _round(v, DTYPE: tl.constexpr, RNE_EMU: tl.constexpr):
    """Round fp32 ``v`` to the storage dtype and back (the unfused layer's intermediate rounding)."""
    return _cast(v, DTYPE, RNE_EMU).to(tl.float32)


@triton.jit
def _rms_scaled(x, rstd, nw, DTYPE: tl.constexpr, RNE_EMU: tl.constexpr):
    """RMSNorm's output in the storage dtype from fp32 ``x``, its ``rstd`` and fp32 weight ``nw``, rounded as HF's
    order rounds it: x * rstd to DTYPE first, then the weight product (reference.py). The GEMV's two forms use it;
    the tile kernel spells the same out inline (as a call, its sm_90 SASS changes: the measured code stays)."""
    return _cast(nw * _round(x * rstd, DTYPE, RNE_EMU), DTYPE, RNE_EMU)


@triton.jit
def _slab_dot(acc, h, w_ptr, offs_n, mask_n, offs_k, mask_k, swn, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    w = tl.load(w_ptr + offs_n[:, None] * swn + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    if UPCAST:
        w = w.to(tl.float32)
    if IEEE:
        return acc + tl.dot(h, tl.trans(w), input_precision="ieee")
    return acc + tl.dot(h, tl.trans(w))


@triton.jit
def _decode_linear_kernel(
    x_ptr, w_ptr, b_ptr, nw_ptr, r_ptr, o_ptr,
    M, K, NO, eps,
    sxm, swn, srm, som,
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, RNE_EMU: tl.constexpr, USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr = False,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    dtype = o_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < NO
    rk = tl.arange(0, BLOCK_K)
    if PREFETCH:  # (PDL only) this program's weight rows into L2 while the kernel before still runs: w is not
        # written by the decode step, and L2 is the point of coherence; kernels/pdl/launch.py
        rows = tl.minimum(offs_n, NO - 1)  # a ragged tile's extra rows prefetch the last row again
        nbytes = tl.zeros([BLOCK_N], dtype=tl.int32) + K * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
        prefetch_rows_l2(w_ptr + rows.to(tl.int64) * swn, nbytes)
        if SILU_MUL:
            prefetch_rows_l2(w_ptr + (rows + NO).to(tl.int64) * swn, nbytes)
    pdl_enter(USE_PDL)  # kernels/pdl: a no-op unless launched with programmatic dependent launch

    if HAS_NORM:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + rk
            xt = tl.load(
                x_ptr + offs_m[:, None] * sxm + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0
            ).to(tl.float32)
            ss += tl.sum(xt * xt, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + rk
        mask_k = offs_k < K
        h = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if HAS_NORM:
            nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            hn = _round(h.to(tl.float32) * rstd[:, None], dtype, RNE_EMU)
            h = _cast(nw[None, :] * hn, dtype, RNE_EMU)
        if UPCAST:
            h = h.to(tl.float32)
        acc = _slab_dot(acc, h, w_ptr, offs_n, mask_n, offs_k, mask_k, swn, UPCAST, IEEE)
        if SILU_MUL:
            acc_up = _slab_dot(acc_up, h, w_ptr + NO * swn, offs_n, mask_n, offs_k, mask_k, swn, UPCAST, IEEE)

    mask_mn = mask_m[:, None] & mask_n[None, :]
    _epilogue(acc, acc_up, b_ptr, r_ptr, o_ptr, offs_m, offs_n, mask_n, mask_mn, NO, srm, som,
              HAS_BIAS, HAS_RES, SILU_MUL, RNE_EMU)  # fmt: skip


@triton.jit
def _epilogue(acc, acc_up, b_ptr, r_ptr, o_ptr, offs_m, offs_n, mask_n, mask_mn, NO, srm, som,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr, RNE_EMU: tl.constexpr):  # fmt: skip
    """Bias, the rounding to the output dtype, SiLU-gate, residual; stores the tile."""
    dtype = o_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(b_ptr + NO + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = _round(acc, dtype, RNE_EMU)
    if SILU_MUL:
        g = _round(y / (1.0 + tl.exp(-y)), dtype, RNE_EMU)
        y = _round(g * _round(acc_up, dtype, RNE_EMU), dtype, RNE_EMU)
    if HAS_RES:
        r = tl.load(r_ptr + offs_m[:, None] * srm + offs_n[None, :], mask=mask_mn, other=0.0).to(tl.float32)
        y = r + y
    tl.store(o_ptr + offs_m[:, None] * som + offs_n[None, :], _cast(y, dtype, RNE_EMU), mask=mask_mn)


@triton.jit
def _gemv_w(w_ptr, offs_n, mask_n, offs_k, mask_k, swn, NO, SILU_MUL: tl.constexpr):
    """The GEMV's w tile [BLOCK_N, len(offs_k)] and, for "silu_mul", the up half's (else w again)."""
    mask_w = mask_n[:, None] & mask_k[None, :]
    w_offs = offs_n[:, None] * swn + offs_k[None, :]
    w = tl.load(w_ptr + w_offs, mask=mask_w, other=0.0)
    w_up = w
    if SILU_MUL:
        w_up = tl.load(w_ptr + NO * swn + w_offs, mask=mask_w, other=0.0)
    return w, w_up


@triton.jit
def gemv_preloaded(
    x_ptr, w_ptr, b_ptr, nw_ptr, r_ptr, o_ptr, pid, NO, eps, swn,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr, KP: tl.constexpr, RNE_EMU: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program ``pid`` of the GEMV's preloaded form (``_gemv_kernel`` with PRELOAD): its whole w slab [BLOCK_N, KP]
    (K padded to the power of two KP) is loaded first, then it waits for its inputs (PDL's ``griddepcontrol.wait``),
    then x (and the residual) are read and the columns written as ``_gemv_kernel`` writes them."""
    dtype = o_ptr.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < NO
    offs_k = tl.arange(0, KP)
    mask_k = offs_k < K
    w, w_up = _gemv_w(w_ptr, offs_n, mask_n, offs_k, mask_k, swn, NO, SILU_MUL)
    pdl_enter(USE_PDL)
    x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
    h = x
    if HAS_NORM:
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / K + eps)
        nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        h = _rms_scaled(xf, rstd, nw, dtype, RNE_EMU)
    h = h.to(tl.float32)[None, :]
    acc = w.to(tl.float32) * h
    acc_up = acc
    if SILU_MUL:
        acc_up = w_up.to(tl.float32) * h
    offs_m = tl.arange(0, 1)
    mask_mn = (offs_m < 1)[:, None] & mask_n[None, :]
    _epilogue(tl.sum(acc, axis=1)[None, :], tl.sum(acc_up, axis=1)[None, :], b_ptr, r_ptr, o_ptr, offs_m, offs_n,
              mask_n, mask_mn, NO, 0, 0, HAS_BIAS, HAS_RES, SILU_MUL, RNE_EMU)  # fmt: skip


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, nw_ptr, r_ptr, o_ptr,
    NO, eps, swn,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RNE_EMU: tl.constexpr, USE_PDL: tl.constexpr,
    PRELOAD: tl.constexpr = False, KP: tl.constexpr = 1,
):  # fmt: skip
    """One row (M = 1): one program per BLOCK_N output columns, fp32 products summed over K in registers (no
    ``tl.dot``, whose 16-row minimum would make the tiles 16x wider than the row). K is a constexpr so the
    BLOCK_K chunks unroll and every chunk's w loads can be in flight at once: a program is small (BLOCK_N rows
    of w), there are many of them (Qwen3-0.6B's o projection: 512 at BLOCK_N 2), and each SM holds several.

    PRELOAD (PDL only): the program's whole w slab (K padded to the power of two KP, one tile) is loaded before
    ``griddepcontrol.wait``, so a kernel launched early by PDL streams its weights while the kernel before it
    still runs; x, the only input that kernel writes, is read after the wait. Safe: the decode step never writes
    w. (The tile kernel's form of this, a bulk prefetch into L2, lost 8% at batch 1 on the H200; this one moves
    the kernel's own loads, no extra traffic.)"""
    if PRELOAD:
        gemv_preloaded(x_ptr, w_ptr, b_ptr, nw_ptr, r_ptr, o_ptr, tl.program_id(0), NO, eps, swn, K, HAS_BIAS,
                       HAS_NORM, HAS_RES, SILU_MUL, BLOCK_N, KP, RNE_EMU, USE_PDL)  # fmt: skip
        return
    dtype = o_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < NO
    rk = tl.arange(0, BLOCK_K)
    pdl_enter(USE_PDL)
    if HAS_NORM:
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            xt = tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            ss += xt * xt
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    # products summed elementwise over the chunks, reduced over K once at the end: no cross-thread reduction
    # (and its barrier) between chunks, so the compiler can issue every chunk's w loads up front
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        offs_k = k0 + rk
        mask_k = offs_k < K
        w, w_up = _gemv_w(w_ptr, offs_n, mask_n, offs_k, mask_k, swn, NO, SILU_MUL)
        h = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
        if HAS_NORM:
            nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            h = _rms_scaled(h.to(tl.float32), rstd, nw, dtype, RNE_EMU)
        h = h.to(tl.float32)[None, :]
        acc += w.to(tl.float32) * h
        if SILU_MUL:
            acc_up += w_up.to(tl.float32) * h
    offs_m = tl.arange(0, 1)
    mask_mn = (offs_m < 1)[:, None] & mask_n[None, :]
    _epilogue(tl.sum(acc, axis=1)[None, :], tl.sum(acc_up, axis=1)[None, :], b_ptr, r_ptr, o_ptr, offs_m, offs_n,
              mask_n, mask_mn, NO, 0, 0, HAS_BIAS, HAS_RES, SILU_MUL, RNE_EMU)  # fmt: skip


SMEM_BUDGET = 160 * 1024  # bytes of pipelined tiles: the H200 sweep's bf16 configs at this estimate compiled and ran


def default_config(m: int, no: int, k: int, silu_mul: bool, elsize: int = 2) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows, No output columns, K inputs of ``elsize``
    bytes.

    GPU: the best of the sweep at M = 1 for all four Qwen3-0.6B layer linears on an H200 (benchmarks/
    decode_linear.py, docs/benchmarks.md) is 32 x 256 tiles, 4 warps, 4 stages; at M = 64 the residual
    linears (o, down: what the engine fuses there) are best at 16 x 256. BLOCK_K is capped by K, then
    halved (down to 64) and the stages cut (down to 2) while stages x (x tile + w tiles) exceeds
    ``SMEM_BUDGET`` (fp32, or 64 rows with two slabs). Interpreter: small tiles so tests cover several
    tiles and ragged edges cheaply."""
    block_m = max(16, triton.next_power_of_2(m)) if m <= 64 else 64
    if INTERPRET:
        return block_m, 16, 32, 4, 1
    block_n = 32 if block_m <= 16 else 16
    block_k = min(256, max(32, triton.next_power_of_2(k)))
    stages = 4

    def smem() -> int:
        return stages * (block_m + (2 if silu_mul else 1) * block_n) * block_k * elsize

    while smem() > SMEM_BUDGET and block_k > 64:
        block_k //= 2
    while smem() > SMEM_BUDGET and stages > 2:
        stages -= 1
    return block_m, block_n, block_k, 4, stages


# Steps of this many rows take the GEMV kernel (``_gemv_kernel``): H200, Qwen3-0.6B, batch 1: 1,129 tok/s vs 927 for
# the tile kernel (docs/benchmarks.md).
GEMV_MAX_ROWS = 1
# ... and K of at most this (the chunks unroll: a longer K means more registers and code; Qwen3-0.6B's longest is
# 3,072; longer K has not been measured and takes the tile kernel)
GEMV_MAX_K = 4096


def uses_gemv(m: int, k: int) -> bool:
    """Whether ``decode_linear`` without a config runs M rows of K inputs on the GEMV kernel."""
    return m <= GEMV_MAX_ROWS and k <= GEMV_MAX_K


def gemv_config(no: int, k: int, silu_mul: bool) -> tuple:
    """("gemv", BLOCK_N, BLOCK_K, num_warps) for one row of No output columns and K inputs. GPU: 2 columns a
    program (Qwen3-0.6B's narrowest output, 1,024 columns, gives 512 programs), K in chunks of up to 1,024, 4
    warps: of the H200 sweep's grid (BLOCK_N 2-16, BLOCK_K 512 / 1024, 2 / 4 warps; docs/benchmarks.md) the one
    config within ~3% of each op's best at all four Qwen3-0.6B layer shapes (down: 4.04 us, against 5.31 at
    4 columns). Interpreter: small chunks so tests cover several of them and ragged edges."""
    if INTERPRET:
        return ("gemv", 4, 32, 1)
    return ("gemv", 2, min(1024, max(64, triton.next_power_of_2(k))), 4)


def _gemv(x_MK, w_NK, bias_N, norm_w_K, eps, residual_MNo, silu_mul, cfg, no) -> torch.Tensor:
    """cfg ("gemv", BLOCK_N, BLOCK_K, warps[, preload]): preload (the whole w slab before PDL's wait) defaults to
    ``pdl.prefetch_enabled()``; tests set it to run that form without PDL."""
    _, block_n, block_k, num_warps = cfg[:4]
    preload = pdl.prefetch_enabled() if len(cfg) < 5 else bool(cfg[4])
    M, K = x_MK.shape
    if M != 1:
        raise ValueError(f"decode_linear: the GEMV config {cfg} takes one row, got {M}")
    out = torch.empty(1, no, device=x_MK.device, dtype=x_MK.dtype)
    _gemv_kernel[(triton.cdiv(no, block_n),)](
        x_MK, w_NK,
        bias_N if bias_N is not None else out,
        norm_w_K if norm_w_K is not None else out,
        residual_MNo if residual_MNo is not None else out,
        out, no, eps, w_NK.stride(0),
        K=K, HAS_BIAS=bias_N is not None, HAS_NORM=norm_w_K is not None, HAS_RES=residual_MNo is not None,
        SILU_MUL=silu_mul, BLOCK_N=block_n, BLOCK_K=block_k,
        RNE_EMU=INTERPRET and x_MK.dtype == torch.bfloat16, USE_PDL=pdl.enabled(), PRELOAD=preload,
        KP=triton.next_power_of_2(K),
        num_warps=num_warps, num_stages=1, **pdl.launch_options(),
    )  # fmt: skip
    return out


def decode_linear(
    x_MK: torch.Tensor,
    w_NK: torch.Tensor,
    bias_N: torch.Tensor | None,
    norm_w_K: torch.Tensor | None,
    eps: float,
    residual_MNo: torch.Tensor | None,
    silu_mul: bool,
    config: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """out [M, No] (reference.py); ``config`` (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) overrides
    ``default_config`` (benchmarks/decode_linear.py sweeps it). Inputs: x, w (and residual) with contiguous last
    dims, one float dtype; checked by op.check_inputs."""
    M, K = x_MK.shape
    no = w_NK.shape[0] // 2 if silu_mul else w_NK.shape[0]
    if config:
        cfg = tuple(config)
    elif uses_gemv(M, K):
        cfg = gemv_config(no, K, silu_mul)
    else:
        cfg = default_config(M, no, K, silu_mul, x_MK.element_size())
    if cfg[0] == "gemv":
        return _gemv(x_MK, w_NK, bias_N, norm_w_K, eps, residual_MNo, silu_mul, cfg, no)
    block_m, block_n, block_k, num_warps, num_stages = cfg
    out = torch.empty(M, no, device=x_MK.device, dtype=x_MK.dtype)
    dummy = out
    grid = (triton.cdiv(no, block_n), triton.cdiv(M, block_m))
    # (PDL) the weight-row prefetch where cp.async.bulk's 16-byte rules hold for the rows
    prefetch = pdl.prefetch_enabled() and pdl.bulk_prefetchable(w_NK, w_NK.stride(0), K)
    _decode_linear_kernel[grid](
        x_MK, w_NK,
        bias_N if bias_N is not None else dummy,
        norm_w_K if norm_w_K is not None else dummy,
        residual_MNo if residual_MNo is not None else dummy,
        out,
        M, K, no, eps,
        x_MK.stride(0), w_NK.stride(0),
        residual_MNo.stride(0) if residual_MNo is not None else 0, out.stride(0),
        HAS_BIAS=bias_N is not None, HAS_NORM=norm_w_K is not None, HAS_RES=residual_MNo is not None,
        SILU_MUL=silu_mul, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=INTERPRET, IEEE=x_MK.dtype == torch.float32 and not INTERPRET,
        RNE_EMU=INTERPRET and x_MK.dtype == torch.bfloat16, USE_PDL=pdl.enabled(), PREFETCH=prefetch,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_options(),
    )  # fmt: skip
    return out
