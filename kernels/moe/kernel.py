"""Triton kernels for MoE experts over rows sorted by expert, and their Python launchers.

Rows: the M = T*K (token, slot) assignments sorted by expert (``reference.sort_by_expert``); expert
e owns rows [offs[e-1], offs[e]). Kernels gather token rows through an index instead of
materializing permuted copies, and scatter outputs back to (token, slot) order, so the only
permutation work outside them is one sort and a K-way sum.

- ``gate_up_swiglu``: h = silu(x Wg^T) * (x Wu^T) per row, gate/up in one pass (two accumulators);
  optionally stores the pre-activations for backward.
- ``grouped_gemm``: out[dst(r)] = scale(r) * A[src(r)] @ B[e(r)] (B any [E, N, K] strides); the
  down projection, and dx / d(h) in backward.
- ``grouped_wgrad``: dW[e] = sum over e's rows of (scale * A[src])^T B[src']; the weight grads.

Row tiles: each program of the row-tiled kernels takes one BLOCK_M tile that lies inside one expert;
the tile -> (expert, row range) table is built on device (``tile_schedule``), sized by the static
bound ceil(M / BLOCK_M) + E, so nothing syncs with the host and empty experts cost nothing.

Launch configs (tile sizes, warps, stages): one per kernel and shape class from ``configs.pick`` by
default; ``configs.AUTOTUNE`` (env PRIME_SPMD_MOE_AUTOTUNE=1) launches the ``*_tuned`` autotuner
wrappers instead (configs.py says why).

Interpreter (CPU, TRITON_INTERPRET=1): tiles upcast to fp32 before ``tl.dot`` (bf16 dots give
garbage there) and one config (several fail). On GPU, bf16 tiles go to the tensor cores.

Legend (docs/conventions.md): M = T*K rows sorted by expert, T tokens, D hidden, I intermediate, F = 2I,
E experts. Local letters of this file: GEMM roles (docs/conventions.md): each kernel is a grouped GEMM
out[rows, N] = A[rows, K] @ B[e][K, N], so in its scalar arguments (``N``, ``K``, ``MW``), tiles (``BLOCK_M``,
``BLOCK_N``, ``BLOCK_K``, ``BLOCK_MW``) and the launcher's ``b_ENK``, N is the GEMM's output columns and K its
reduction dim, never heads or top-k. Per launch: gate_up N = I (gate and up each), K = D; grouped_gemm N = D
and K = I (down projection) or K = F (dx); dz_swiglu_bwd N = I, K = D; grouped_wgrad writes [E, MW, N] with
MW = D, N = I (dW2) or MW = F, N = D (dW13), its BLOCK_K stepping over an expert's rows. Also R row tiles of
the tile table (``num_tiles``), P column blocks of the router-weight partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from prime_spmd.kernels.moe import configs

INTERPRET = configs.INTERPRET
BLOCK_M = 32 if INTERPRET else 128  # rows per tile: fixed (the tile table depends on it), not autotuned
GROUP_M = 8  # row tiles per program group in the row kernels' launch order (L2 reuse)
FUSE_SWIGLU_BWD = True  # SwiGLU backward in the dz GEMM's epilogue (False: a separate elementwise kernel)
ROW_CONFIGS, WGRAD_CONFIGS = configs.ROW_CONFIGS, configs.WGRAD_CONFIGS


def tile_schedule(offs_E: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Per row tile: expert, first row, end row (int32 [R = num_tiles]); idle tiles have start == end."""
    E = offs_E.numel()
    ends_E = offs_E.long()
    starts_E = torch.cat([ends_E.new_zeros(1), ends_E[:-1]])
    tiles_E = (ends_E - starts_E + BLOCK_M - 1) // BLOCK_M
    tile_end_E = tiles_E.cumsum(0)
    num_tiles = triton.cdiv(num_rows, BLOCK_M) + E
    pid_R = torch.arange(num_tiles, device=ends_E.device)
    e_R = torch.searchsorted(tile_end_E, pid_R, right=True).clamp(max=E - 1)
    row0_R = starts_E[e_R] + (pid_R - (tile_end_E - tiles_E)[e_R]) * BLOCK_M
    row1_R = ends_E[e_R]
    idle_R = row0_R >= row1_R
    row0_R = torch.where(idle_R, 0, row0_R)
    row1_R = torch.where(idle_R, 0, row1_R)
    return e_R.int(), row0_R.int(), row1_R.int(), num_tiles


@triton.jit
def _tile_ids(num_tiles, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """1-D program id -> (row tile, column block), GROUP_M row tiles at a time so that the programs
    running together share A rows and B columns in L2 (grouped ordering)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_tiles - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _row_tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, pid_m, BLOCK_M: tl.constexpr):
    """Row tile pid_m of the tile table: expert (int64), row indices, row mask, and whether it is idle."""
    r0, r1 = tl.load(tile_r0_ptr + pid_m), tl.load(tile_r1_ptr + pid_m)
    rows = r0 + tl.arange(0, BLOCK_M)
    return tl.load(tile_e_ptr + pid_m).to(tl.int64), rows, rows < r1, r0 >= r1


@triton.jit
def _rows_dot(
    a_ptr, arow, rmask, stride_am, b_ptr, stride_bk, stride_bn, cols, cmask, K,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_M, BLOCK_N] = A[arow, :K] @ B[:K, cols] (A rows by index, B by strides); inlined by Triton."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        a = tl.load(a_ptr + arow[:, None] * stride_am + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(
            b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=kmask[:, None] & cmask[None, :],
            other=0.0,
        )
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _swiglu_bwd_tile(dz, gu_ptr, scale_ptr, dgu_ptr, rows, rmask, cols, cmask, N, stride_gm):
    """SwiGLU backward of one [rows, cols] tile of dz (fp32): stores d(gate|up) = scale * dz * dSwiGLU from
    the gate|up pre-activations and returns this tile's part of rowsum(h * dz) (the router-weight grad)."""
    rows64 = rows.to(tl.int64)
    mask = rmask[:, None] & cmask[None, :]
    gptr = gu_ptr + rows64[:, None] * stride_gm + cols[None, :]
    g = tl.load(gptr, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gptr + N, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dh = dz * tl.load(scale_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    dptr = dgu_ptr + rows64[:, None] * stride_gm + cols[None, :]
    tl.store(dptr, (dh * u * (sig + silu * (1.0 - sig))).to(dgu_ptr.dtype.element_ty), mask=mask)
    tl.store(dptr + N, (dh * silu).to(dgu_ptr.dtype.element_ty), mask=mask)
    return tl.sum(silu * u * dz, axis=1)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, gu_ptr, tok_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
    num_tiles, N, K, stride_xm, stride_we, stride_wn, stride_wk, stride_hm, stride_gm,
    STORE_GU: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_ids(num_tiles, N, BLOCK_N, GROUP_M)
    e, rows, rmask, idle = _row_tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, pid_m, BLOCK_M)
    if idle:
        return
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + e * stride_we
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        a = tl.load(x_ptr + tok[:, None] * stride_xm + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        bmask = kmask[:, None] & cmask[None, :]
        bg = tl.load(w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn, mask=bmask, other=0.0)
        bu = tl.load(w_base + ks[:, None] * stride_wk + (cols[None, :] + N) * stride_wn, mask=bmask, other=0.0)
        if UPCAST:
            a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
        acc_g = tl.dot(a, bg, acc_g)
        acc_u = tl.dot(a, bu, acc_u)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    omask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    tl.store(h_ptr + rows64[:, None] * stride_hm + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=omask)
    if STORE_GU:
        gptr = gu_ptr + rows64[:, None] * stride_gm + cols[None, :]
        tl.store(gptr, acc_g.to(gu_ptr.dtype.element_ty), mask=omask)
        tl.store(gptr + N, acc_u.to(gu_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, out_ptr, a_idx_ptr, out_idx_ptr, scale_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
    num_tiles, N, K, stride_am, stride_be, stride_bn, stride_bk, stride_om,
    A_GATHER: tl.constexpr, OUT_SCATTER: tl.constexpr, HAS_SCALE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_ids(num_tiles, N, BLOCK_N, GROUP_M)
    e, rows, rmask, idle = _row_tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, pid_m, BLOCK_M)
    if idle:
        return
    if A_GATHER:
        arow = tl.load(a_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        arow = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = _rows_dot(
        a_ptr, arow, rmask, stride_am, b_ptr + e * stride_be, stride_bk, stride_bn, cols, cmask, K,
        UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    if OUT_SCATTER:
        orow = tl.load(out_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        orow = rows.to(tl.int64)
    omask = rmask[:, None] & cmask[None, :]
    tl.store(out_ptr + orow[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _dz_swiglu_bwd_kernel(
    dout_ptr, w2_ptr, gu_ptr, scale_ptr, tok_ptr, dgu_ptr, dwp_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
    num_tiles, N, K, stride_dm, stride_we, stride_wn, stride_wk, stride_gm, stride_pm,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """dz = dout[tok] @ W2[e] (N = I columns), then in the epilogue the SwiGLU backward from the stored
    gate|up pre-activations: d(gate|up) = scale * dz * dSwiGLU, and this column block's share of the
    router-weight grad, rowsum(h * dz), written to dwp[row, pid_n] (summed by the launcher)."""
    pid_m, pid_n = _tile_ids(num_tiles, N, BLOCK_N, GROUP_M)
    e, rows, rmask, idle = _row_tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, pid_m, BLOCK_M)
    if idle:
        return
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = _rows_dot(
        dout_ptr, tok, rmask, stride_dm, w2_ptr + e * stride_we, stride_wk, stride_wn, cols, cmask, K,
        UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    dw = _swiglu_bwd_tile(acc, gu_ptr, scale_ptr, dgu_ptr, rows, rmask, cols, cmask, N, stride_gm)
    tl.store(dwp_ptr + rows.to(tl.int64) * stride_pm + pid_n, dw, mask=rmask)


@triton.jit
def _swiglu_bwd_kernel(
    dz_ptr, gu_ptr, scale_ptr, dgu_ptr, dw_ptr, M, N, stride_zm, stride_gm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Unfused SwiGLU backward (the split variant of the dz kernel's epilogue), BLOCK_M whole rows per program
    (BLOCK_N >= N = I columns)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    mask = rmask[:, None] & (cols < N)[None, :]
    dz = tl.load(dz_ptr + rows.to(tl.int64)[:, None] * stride_zm + cols[None, :], mask=mask, other=0.0)
    dw = _swiglu_bwd_tile(dz.to(tl.float32), gu_ptr, scale_ptr, dgu_ptr, rows, rmask, cols, cols < N, N, stride_gm)
    tl.store(dw_ptr + rows, dw, mask=rmask)


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, b_ptr, out_ptr, a_idx_ptr, b_idx_ptr, scale_ptr, offs_ptr,
    MW, N, stride_am, stride_bm, stride_oe, stride_om,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_MW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[e, i, j] = sum over expert e's rows r of scale[r] * A[ia(r), i] * B[ib(r), j]."""
    pid, e = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    r1 = tl.load(offs_ptr + e)
    r0 = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    ms = pid_m * BLOCK_MW + tl.arange(0, BLOCK_MW)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = ms < MW, ns < N
    acc = tl.zeros((BLOCK_MW, BLOCK_N), dtype=tl.float32)
    for k0 in range(r0, r1, BLOCK_K):
        rows = k0 + tl.arange(0, BLOCK_K)
        rmask = rows < r1
        if A_GATHER:
            ia = tl.load(a_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            ia = rows.to(tl.int64)
        if B_GATHER:
            ib = tl.load(b_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            ib = rows.to(tl.int64)
        at = tl.load(a_ptr + ia[None, :] * stride_am + ms[:, None], mask=mmask[:, None] & rmask[None, :], other=0.0)
        if HAS_SCALE:
            s = tl.load(scale_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            at = (at.to(tl.float32) * s[None, :]).to(at.dtype)
        b = tl.load(b_ptr + ib[:, None] * stride_bm + ns[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        if UPCAST:
            at, b = at.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(at, b, acc)
    optr = out_ptr + e.to(tl.int64) * stride_oe + ms[:, None].to(tl.int64) * stride_om + ns[None, :]
    tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


# The autotuned variants (opt-in, configs.AUTOTUNE): each new key sweeps every config of the space.
TUNED = {
    "gate_up": triton.autotune(configs=ROW_CONFIGS, key=["N", "K", "BLOCK_M"])(_gate_up_kernel),
    "grouped_gemm": triton.autotune(configs=ROW_CONFIGS, key=["N", "K", "A_GATHER", "OUT_SCATTER", "BLOCK_M"])(
        _grouped_gemm_kernel
    ),
    # configs write different dwp columns
    "dz_swiglu_bwd": triton.autotune(configs=ROW_CONFIGS, key=["N", "K", "BLOCK_M"], reset_to_zero=["dwp_ptr"])(
        _dz_swiglu_bwd_kernel
    ),
    "grouped_wgrad": triton.autotune(configs=WGRAD_CONFIGS, key=["MW", "N", "A_GATHER", "B_GATHER"])(
        _grouped_wgrad_kernel
    ),
}
JIT = {
    "gate_up": _gate_up_kernel,
    "grouped_gemm": _grouped_gemm_kernel,
    "dz_swiglu_bwd": _dz_swiglu_bwd_kernel,
    "grouped_wgrad": _grouped_wgrad_kernel,
}


def _upcast(t: torch.Tensor) -> bool:
    return INTERPRET or t.dtype == torch.float32


def _config(kernel: str, t: torch.Tensor, N: int, K: int, MW: int | None = None) -> triton.Config | None:
    """This launch's config from the table (None: the autotuner chooses), for inputs like ``t``."""
    if configs.AUTOTUNE:
        return None
    budget = configs.smem_budget(t.device.index or 0) if t.is_cuda and not INTERPRET else 0
    return configs.pick(kernel, N, K, block_m=BLOCK_M, elem_bytes=t.element_size(), smem_budget=budget, MW=MW)


def _launch(kernel: str, cfg: triton.Config | None, grid, *args, **kwargs) -> None:
    """Launch ``kernel`` with ``cfg``, or through its autotuner when ``cfg`` is None."""
    if cfg is None:
        TUNED[kernel][grid](*args, **kwargs)
    else:
        JIT[kernel][grid](*args, **kwargs, **configs.launch_kwargs(cfg))


def gate_up_swiglu(
    x_TD: torch.Tensor, tok_M: torch.Tensor, w13_EFD: torch.Tensor, sched, store_gu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, I] = silu(x[tok] Wg^T) * (x[tok] Wu^T); and gate|up pre-activations [M, F] (empty unless store_gu)."""
    tile_e, r0, r1, num_tiles = sched
    M, (_, F, D) = tok_M.numel(), w13_EFD.shape
    inter = F // 2
    h_MI = x_TD.new_empty(M, inter)
    gu_MF = x_TD.new_empty(M if store_gu else 0, F)
    assert x_TD.stride(1) == 1 and w13_EFD.stride(2) == 1
    grid = lambda meta: (num_tiles * triton.cdiv(inter, meta["BLOCK_N"]),)  # noqa: E731
    _launch(
        "gate_up", _config("gate_up", x_TD, inter, D), grid, x_TD, w13_EFD, h_MI, gu_MF, tok_M, tile_e, r0, r1,
        num_tiles, inter, D, x_TD.stride(0), w13_EFD.stride(0), w13_EFD.stride(1), w13_EFD.stride(2), h_MI.stride(0), F,
        STORE_GU=store_gu, UPCAST=_upcast(x_TD), BLOCK_M=BLOCK_M, GROUP_M=GROUP_M,
    )  # fmt: skip
    return h_MI, gu_MF


def grouped_gemm(
    a: torch.Tensor,
    b_ENK: torch.Tensor,
    sched,
    num_out_rows: int,
    a_idx: torch.Tensor | None = None,
    out_idx: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[out_idx[r]] = scale[r] * a[a_idx[r]] @ b[e(r)]^T-as-[N, K]; ``b_ENK`` may be any strided view."""
    tile_e, r0, r1, num_tiles = sched
    E, N, K = b_ENK.shape
    assert a.stride(1) == 1
    out = a.new_empty(num_out_rows, N)
    dummy = tile_e
    grid = lambda meta: (num_tiles * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _launch(
        "grouped_gemm", _config("grouped_gemm", a, N, K), grid,
        a, b_ENK, out, dummy if a_idx is None else a_idx, dummy if out_idx is None else out_idx,
        dummy if scale is None else scale, tile_e, r0, r1,
        num_tiles, N, K, a.stride(0), b_ENK.stride(0), b_ENK.stride(1), b_ENK.stride(2), out.stride(0),
        A_GATHER=a_idx is not None, OUT_SCATTER=out_idx is not None, HAS_SCALE=scale is not None,
        UPCAST=_upcast(a), BLOCK_M=BLOCK_M, GROUP_M=GROUP_M,
    )  # fmt: skip
    return out


def dz_swiglu_bwd(
    dout_TD: torch.Tensor, tok_M: torch.Tensor, w2_EDI: torch.Tensor, gu_MF: torch.Tensor, scale_M: torch.Tensor, sched
) -> tuple[torch.Tensor, torch.Tensor]:
    """d(gate|up) [M, F] (x's dtype) and the router-weight grad per sorted row [M] (fp32) from dout [T, D]."""
    tile_e, r0, r1, num_tiles = sched
    if not FUSE_SWIGLU_BWD:
        return _dz_then_swiglu_bwd(dout_TD, tok_M, w2_EDI, gu_MF, scale_M, sched)
    M, F = gu_MF.shape
    inter = F // 2
    assert dout_TD.stride(1) == 1 and gu_MF.stride(1) == 1
    dgu_MF = torch.empty_like(gu_MF)
    cfg = _config("dz_swiglu_bwd", dout_TD, inter, dout_TD.shape[1])
    min_bn = min(c.kwargs["BLOCK_N"] for c in ([cfg] if cfg is not None else ROW_CONFIGS))
    dwp_MP = torch.zeros(M, triton.cdiv(inter, min_bn), device=gu_MF.device, dtype=torch.float32)
    w2_EID = w2_EDI.transpose(1, 2)  # [E, N=I, K=D] view
    grid = lambda meta: (num_tiles * triton.cdiv(inter, meta["BLOCK_N"]),)  # noqa: E731
    _launch(
        "dz_swiglu_bwd", cfg, grid, dout_TD, w2_EID, gu_MF, scale_M, tok_M, dgu_MF, dwp_MP, tile_e, r0, r1,
        num_tiles, inter, dout_TD.shape[1], dout_TD.stride(0), w2_EID.stride(0), w2_EID.stride(1), w2_EID.stride(2),
        gu_MF.stride(0), dwp_MP.stride(0),
        UPCAST=_upcast(dout_TD), BLOCK_M=BLOCK_M, GROUP_M=GROUP_M,
    )  # fmt: skip
    return dgu_MF, dwp_MP.sum(1)


def _dz_then_swiglu_bwd(dout_TD, tok_M, w2_EDI, gu_MF, scale_M, sched) -> tuple[torch.Tensor, torch.Tensor]:
    """The split variant of ``dz_swiglu_bwd``: the dz GEMM to memory, then an elementwise kernel."""
    M, F = gu_MF.shape
    dz_MI = grouped_gemm(dout_TD, w2_EDI.transpose(1, 2), sched, M, a_idx=tok_M)
    dgu_MF = torch.empty_like(gu_MF)
    dw_M = torch.empty(M, device=gu_MF.device, dtype=torch.float32)
    block_n = triton.next_power_of_2(F // 2)
    block_m = max(1, 8192 // block_n)
    _swiglu_bwd_kernel[(triton.cdiv(M, block_m),)](
        dz_MI,
        gu_MF,
        scale_M,
        dgu_MF,
        dw_M,
        M,
        F // 2,
        dz_MI.stride(0),
        gu_MF.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return dgu_MF, dw_M


def grouped_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    offs_E: torch.Tensor,
    a_idx: torch.Tensor | None = None,
    b_idx: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [E, MW, N]: out[e] = sum over e's rows r of scale[r] * outer(a[a_idx[r]], b[b_idx[r]])."""
    E, MW, N = offs_E.numel(), a.shape[1], b.shape[1]
    assert a.stride(1) == 1 and b.stride(1) == 1
    out = a.new_empty(E, MW, N)
    dummy = offs_E
    grid = lambda meta: (triton.cdiv(MW, meta["BLOCK_MW"]) * triton.cdiv(N, meta["BLOCK_N"]), E)  # noqa: E731
    cfg = _config("grouped_wgrad", a, N, 1, MW=MW)  # K: its reduction runs over rows, a per-expert count
    _launch(
        "grouped_wgrad", cfg, grid, a, b, out, dummy if a_idx is None else a_idx, dummy if b_idx is None else b_idx,
        dummy if scale is None else scale, offs_E,
        MW, N, a.stride(0), b.stride(0), out.stride(0), out.stride(1),
        A_GATHER=a_idx is not None, B_GATHER=b_idx is not None, HAS_SCALE=scale is not None, UPCAST=_upcast(a),
    )  # fmt: skip
    return out
