"""Triton: the per-output-channel FP8 quantize and the decode linears that read FP8 weights (reference.py: the math).

``quantize_fp8``: one program per row of w: the row's amax over K in BLOCK_K chunks, then the row again, divided by
its scale (IEEE ``div_rn``, as torch divides) and cast to e4m3 (round to nearest even), written in place into a
``q_NK`` / ``scale_N`` that may be row slices of a larger fused tensor.

``fp8_decode_linear``: kernels/decode_linear's two kernels (the one-row GEMV and the row-tile kernel) with the weight
read as FP8 (half of bf16's bytes: the decode step is bound by reading the weights) and converted in registers, fp32
accumulation, and each output column scaled once before the shared epilogue (``decode_linear.kernel._epilogue``:
bias, rounding, SiLU-gate, residual). The prologue (RMSNorm) and epilogue are the bf16 kernels' own jit functions,
so the FP8 path rounds as they do. The GEMV has its own config (``gemv_config``: twice bf16's columns a program, for
the same bytes) and K bound (``op.GEMV_MAX_K``, 16,384); its PDL weight preload is ported (PRELOAD, up to
``PRELOAD_MAX_K``); the tile kernel's L2 prefetch is not. w loads are 16 bytes a thread (16 e4m3) where the launch's
row stride is a multiple of 16, as ``check_fp8_supported`` makes it.

Interpreter (TRITON_INTERPRET=1): its fp32 -> fp8 cast does not round to nearest even, so the quantize rounds in the
fp32 bits first (keep 3 mantissa bits; exact for normal e4m3 values, subnormals may differ by one step), and tiles
are upcast to fp32 before ``tl.dot``.

Legend (docs/conventions.md, GEMM roles): M rows, K in, N out features of w, No output columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from prime_spmd.kernels.decode_linear import kernel as dl
from prime_spmd.kernels.decode_linear.kernel import _cast, _epilogue, _gemv_w, _rms_scaled, _round
from prime_spmd.kernels.fp8.op import uses_gemv
from prime_spmd.kernels.fp8.reference import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from prime_spmd.kernels.pdl import launch as pdl
from prime_spmd.kernels.pdl.launch import pdl_enter

INTERPRET = dl.INTERPRET
# globals a kernel reads must be constexpr (compiled Triton refuses others; the interpreter does not check)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _quantize_kernel(w_ptr, q_ptr, s_ptr, K, sw, sq, BLOCK_K: tl.constexpr, RNE_EMU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(w_ptr + row * sw + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), _AMAX_FLOOR), _FP8_MAX)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + rk < K
        v = tl.load(w_ptr + row * sw + k0 + rk, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.div_rn(v, scale), -_FP8_MAX), _FP8_MAX)
        if RNE_EMU:  # round to 3 mantissa bits in the fp32 bits (add 0x7FFFF plus the kept lowest bit, drop 20 bits)
            bits = v.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20
            v = bits.to(tl.float32, bitcast=True)
        tl.store(q_ptr + row * sq + k0 + rk, v.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_fp8(w_NK: torch.Tensor, q_NK: torch.Tensor, scale_N: torch.Tensor) -> None:
    """Write ``q_NK`` (float8_e4m3fn) and ``scale_N`` (fp32) of ``w_NK`` in place; rows with contiguous last dims."""
    n, k = w_NK.shape
    block_k = 64 if INTERPRET else min(2048, triton.next_power_of_2(k))
    _quantize_kernel[(n,)](
        w_NK, q_NK, scale_N, k, w_NK.stride(0), q_NK.stride(0),
        BLOCK_K=block_k, RNE_EMU=INTERPRET, num_warps=1 if INTERPRET else 8,
    )  # fmt: skip


@triton.jit
def _scale_cols(s_ptr, offs_n, mask_n, NO, SILU_MUL: tl.constexpr):
    """The per-column scales of the output tile and, for "silu_mul", of the up half's columns (else the same)."""
    s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    s_up = s
    if SILU_MUL:
        s_up = tl.load(s_ptr + NO + offs_n, mask=mask_n, other=0.0)
    return s, s_up


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, nw_ptr, r_ptr, o_ptr,
    NO, eps, swn,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RNE_EMU: tl.constexpr, USE_PDL: tl.constexpr,
    PRELOAD: tl.constexpr = False, KP: tl.constexpr = 1,
):  # fmt: skip
    """One row: decode_linear's ``_gemv_kernel`` over FP8 w, each column's sum times its scale. PRELOAD (PDL): the
    program's whole w slab (K padded to KP) and its scales are loaded before PDL's wait, as the bf16 kernel's
    ``gemv_preloaded`` does (the decode step never writes w or the scales; the quantize runs outside it)."""
    dtype = o_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < NO
    if PRELOAD:
        offs_kp = tl.arange(0, KP)
        mask_kp = offs_kp < K
        w, w_up = _gemv_w(w_ptr, offs_n, mask_n, offs_kp, mask_kp, swn, NO, SILU_MUL)
        s, s_up = _scale_cols(s_ptr, offs_n, mask_n, NO, SILU_MUL)
        pdl_enter(USE_PDL)
        xf = tl.load(x_ptr + offs_kp, mask=mask_kp, other=0.0).to(tl.float32)
        h = xf
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / K + eps)
            nw = tl.load(nw_ptr + offs_kp, mask=mask_kp, other=0.0).to(tl.float32)
            h = _rms_scaled(xf, rstd, nw, dtype, RNE_EMU).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * h[None, :], axis=1) * s
        y_up = y
        if SILU_MUL:
            y_up = tl.sum(w_up.to(tl.float32) * h[None, :], axis=1) * s_up
        offs_m1 = tl.arange(0, 1)
        mask_mn1 = (offs_m1 < 1)[:, None] & mask_n[None, :]
        _epilogue(y[None, :], y_up[None, :], b_ptr, r_ptr, o_ptr, offs_m1, offs_n, mask_n, mask_mn1, NO, 0, 0,
                  HAS_BIAS, HAS_RES, SILU_MUL, RNE_EMU)  # fmt: skip
        return
    rk = tl.arange(0, BLOCK_K)
    pdl_enter(USE_PDL)
    if HAS_NORM:
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            xt = tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            ss += xt * xt
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
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
    s, s_up = _scale_cols(s_ptr, offs_n, mask_n, NO, SILU_MUL)
    offs_m = tl.arange(0, 1)
    mask_mn = (offs_m < 1)[:, None] & mask_n[None, :]
    _epilogue((tl.sum(acc, axis=1) * s)[None, :], (tl.sum(acc_up, axis=1) * s_up)[None, :], b_ptr, r_ptr, o_ptr,
              offs_m, offs_n, mask_n, mask_mn, NO, 0, 0, HAS_BIAS, HAS_RES, SILU_MUL, RNE_EMU)  # fmt: skip


PRELOAD_MAX_K = 4096
"""The GEMV's PRELOAD form (whole slab in registers before PDL's wait) up to this K; longer rows (Qwen3-8B's down,
12,288) run the chunked form: sm_90 compile at K 12,288, 4 columns, 4 warps: 249 registers preloaded (one program an
SM), 56 chunked with 8 warps (4 programs an SM)."""


def gemv_config(no: int, k: int, silu_mul: bool) -> tuple:
    """("gemv", BLOCK_N, BLOCK_K, num_warps) of the FP8 GEMV for one row of No columns and K inputs. GPU: 4 columns a
    program, twice the bf16 GEMV's 2 (decode_linear.kernel.gemv_config, the H200 sweep's best at the Qwen3-0.6B
    shapes), so a program streams the same weight bytes as the measured bf16 one and re-reads x (and the norm weight)
    from L2 once per 4 rows, not 2. Bytes in flight an SM, from the sm_90 compile's registers (preloaded, K 4,096,
    norm, 4 warps): bf16 at 2 columns 82 registers, 6 programs x 16 KB = 96 KB; FP8 at 2 columns 72, 7 x 8 KB = 56 KB
    (and as many bytes of x and norm weight read from L2 as of w from HBM); FP8 at 4 columns 95, 5 x 16 KB = 80 KB.
    8 warps past ``PRELOAD_MAX_K`` (the chunked form's registers). Not measured on a GPU yet:
    benchmarks/fp8_linear.py sweeps it. Interpreter: decode_linear's small chunks."""
    if INTERPRET:
        return dl.gemv_config(no, k, silu_mul)
    return ("gemv", 4, min(1024, max(64, triton.next_power_of_2(k))), 4 if k <= PRELOAD_MAX_K else 8)


@triton.jit
def _fp8_slab_dot(acc, h, w_ptr, offs_n, mask_n, offs_k, mask_k, swn, IEEE: tl.constexpr):
    w = tl.load(w_ptr + offs_n[:, None] * swn + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    w = w.to(h.dtype)  # e4m3 -> bf16 (or fp32) is exact
    if IEEE:
        return acc + tl.dot(h, tl.trans(w), input_precision="ieee")
    return acc + tl.dot(h, tl.trans(w))


@triton.jit
def _fp8_tile_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, nw_ptr, r_ptr, o_ptr,
    M, K, NO, eps,
    sxm, swn, srm, som,
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, RNE_EMU: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Rows in tiles: decode_linear's ``_decode_linear_kernel`` (no L2 prefetch) over FP8 w, scaled per column."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    dtype = o_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < NO
    rk = tl.arange(0, BLOCK_K)
    pdl_enter(USE_PDL)
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
        acc = _fp8_slab_dot(acc, h, w_ptr, offs_n, mask_n, offs_k, mask_k, swn, IEEE)
        if SILU_MUL:
            acc_up = _fp8_slab_dot(acc_up, h, w_ptr + NO * swn, offs_n, mask_n, offs_k, mask_k, swn, IEEE)
    s, s_up = _scale_cols(s_ptr, offs_n, mask_n, NO, SILU_MUL)
    mask_mn = mask_m[:, None] & mask_n[None, :]
    _epilogue(acc * s[None, :], acc_up * s_up[None, :], b_ptr, r_ptr, o_ptr, offs_m, offs_n, mask_n, mask_mn, NO,
              srm, som, HAS_BIAS, HAS_RES, SILU_MUL, RNE_EMU)  # fmt: skip


def fp8_decode_linear(
    x_MK: torch.Tensor,
    q_NK: torch.Tensor,
    scale_N: torch.Tensor,
    bias_N: torch.Tensor | None,
    norm_w_K: torch.Tensor | None,
    eps: float,
    residual_MNo: torch.Tensor | None,
    silu_mul: bool,
    config: tuple | None = None,
) -> torch.Tensor:
    """out [M, No] (reference.fp8_decode_linear_reference). One row of K <= ``op.GEMV_MAX_K`` takes the GEMV
    (``gemv_config``), else the tile kernel; ``config`` overrides the tiles as in
    ``decode_linear.kernel.decode_linear``, or the GEMV's as ("gemv", BLOCK_N, BLOCK_K, warps[, preload])."""
    M, K = x_MK.shape
    no = q_NK.shape[0] // 2 if silu_mul else q_NK.shape[0]
    cfg = tuple(config) if config else (gemv_config(no, K, silu_mul) if uses_gemv(M, K) else None)
    if cfg is None:
        cfg = dl.default_config(M, no, K, silu_mul, x_MK.element_size())
    out = torch.empty(M, no, device=x_MK.device, dtype=x_MK.dtype)
    flags = dict(HAS_BIAS=bias_N is not None, HAS_NORM=norm_w_K is not None, HAS_RES=residual_MNo is not None,
                 SILU_MUL=silu_mul, RNE_EMU=INTERPRET and x_MK.dtype == torch.bfloat16, USE_PDL=pdl.enabled())  # fmt: skip
    ptrs = (
        x_MK, q_NK, scale_N,
        bias_N if bias_N is not None else out,
        norm_w_K if norm_w_K is not None else out,
        residual_MNo if residual_MNo is not None else out,
        out,
    )  # fmt: skip
    if cfg[0] == "gemv":
        _, block_n, block_k, num_warps = cfg[:4]
        # as decode_linear's GEMV, up to PRELOAD_MAX_K; tests and benchmarks/fp8_linear.py force it
        preload = pdl.prefetch_enabled() and K <= PRELOAD_MAX_K if len(cfg) < 5 else bool(cfg[4])
        if M != 1:
            raise ValueError(f"fp8_decode_linear: the GEMV config {cfg} takes one row, got {M}")
        _fp8_gemv_kernel[(triton.cdiv(no, block_n),)](
            *ptrs, no, eps, q_NK.stride(0), K=K, BLOCK_N=block_n, BLOCK_K=block_k, **flags,
            PRELOAD=preload, KP=triton.next_power_of_2(K),
            num_warps=num_warps, num_stages=1, **pdl.launch_options(),
        )  # fmt: skip
        return out
    block_m, block_n, block_k, num_warps, num_stages = cfg
    grid = (triton.cdiv(no, block_n), triton.cdiv(M, block_m))
    _fp8_tile_kernel[grid](
        *ptrs, M, K, no, eps, x_MK.stride(0), q_NK.stride(0),
        residual_MNo.stride(0) if residual_MNo is not None else 0, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=INTERPRET, IEEE=x_MK.dtype == torch.float32 and not INTERPRET, **flags,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_options(),
    )  # fmt: skip
    return out


__all__ = ["FP8_DTYPE", "fp8_decode_linear", "quantize_fp8"]
