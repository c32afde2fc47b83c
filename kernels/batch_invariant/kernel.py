"""Batch-invariant Triton kernels: every output row is reduced in an order fixed by the tile constants below, never
by how many rows, tokens or sequences a launch holds (no split-KV, no shape-dependent config).

What makes a row's value independent of the launch: one tile shape per kernel (constants, not autotuned), the
reduction dims (K of a matmul, D of a norm, KV positions of attention, V of the log-softmax) walked in fixed blocks
from index 0 in one order, and no argument specialization that could pick another instruction (``do_not_specialize``
on the row counts). Rows that share a tile are independent in ``tl.dot`` and in row reductions. The matmul's K is
cut into fixed chunks (MM_CHUNK_K) whose fp32 sums are added in chunk order; small launches (decode) split the
chunks over programs and add them in a second kernel, large ones loop over them in one program: the same additions.

Under TRITON_INTERPRET=1 (CPU tests) ``tl.dot`` of bf16 is not usable, so ``UPCAST`` loads bf16 and multiplies in
fp32: bf16 x bf16 products are exact in fp32, accumulation stays fp32, as on the GPU's tensor cores.

Legend: M rows, N output columns, K reduction dim (matmul); R rows, D normalized dim; B rows (sequences),
Tq query tokens of a row, Tk key positions, N query heads, Nkv kv heads, G = N / Nkv, Dh head dim; V vocab.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# matmul tiles (one config for every M: decode rows and training tokens reduce K the same way). BLOCK_N 64 rather than
# 128: a decode step's M <= 64 rows fill one M tile, so the N tiles are its only parallelism (Qwen3-0.6B's o_proj:
# 16 programs instead of 8). BLOCK_N 32 measured slower on the H100 (docs/log.md 2026-12-07: 286 against 383 tokens/s
# at batch 1).
MM_BLOCK_M, MM_BLOCK_N, MM_BLOCK_K = 64, 64, 64
MM_WARPS, MM_STAGES = 4, 3
# the matmul's K order (``_mm_sum``): K cut into fixed chunks of MM_CHUNK_K from 0 (the last may be partial), each
# chunk summed from zero in BLOCK_K steps, the chunk sums added in chunk order. Fixed chunks let a launch with one M
# tile (decode) run one program per (N tile, chunk) and still add the same fp32 numbers in the same order as the
# trainer's one program per tile: 256 = 4 BLOCK_K steps gives Qwen3-0.6B's batch-1 decode matmuls 128-384 programs
# (o_proj: 16 N tiles x 8 chunks) for the H100's 132 SMs, where whole-K tiles gave 16-96.
MM_CHUNK_K = 4 * MM_BLOCK_K
# launches with at most this many rows (one M tile) run split over chunks plus a reduce kernel; larger ones (the
# trainer's micro-batches, prefill) fused, one program a tile looping over the chunks. The choice changes no bit.
MM_SPLIT_MAX_M = MM_BLOCK_M
# ... and whose N tiles alone fill fewer programs than this: a wider launch (the LM head: 2,374 tiles at V = 151,936)
# has the parallelism already, and split would write and read an fp32 workspace of S x M x N (156 MB at 64 rows)
MM_SPLIT_MAX_N_TILES = 512
# elements per program of the matmul's split-K reduce kernel (element-wise: any value gives the same bits)
MM_REDUCE_BLOCK = 256
# elements per program of the row-wise kernels (norm, SiLU-gate): rows per program = ROW_ELEMS // the padded row
# length, a function of the row length only
ROW_ELEMS = 4096
# attention: BLOCK_T query tokens x BLOCK_G heads of one kv head per program, KV walked in BLOCK_N positions
ATTN_BLOCK_T, ATTN_BLOCK_N = 16, 64
# log-softmax: the vocab walked in chunks of LOGPROB_BLOCK_V
LOGPROB_BLOCK_V = 2048


@triton.jit
def _mm_chunk(
    x_ptr, w_ptr, M, N, K, sxm, sxk, swn, swk, rm, rn, k_lo, k_hi,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The fp32 partial x[rm, k_lo:k_hi] @ w[rn, k_lo:k_hi].T, summed from zero in BLOCK_K steps from k_lo: one
    chunk of ``_mm_sum``. Rows and columns past the edges read rows M - ... again (index modulo M, N: unmasked loads
    the loop can pipeline); EVEN_K (K % BLOCK_K == 0, a property of the weight) drops the K mask. The bounds are
    runtime values, so the loop stays a loop: a one-step chunk is not folded into a bare ``dot(x, w, 0)``, which
    Triton's combine pass would merge with the caller's ``total + partial`` into ``dot(x, w, total)`` (another
    order)."""
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (rm % M)[:, None] * sxm + (k_lo + rk)[None, :] * sxk
    w_ptrs = w_ptr + (rn % N)[None, :] * swn + (k_lo + rk)[:, None] * swk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(k0 + rk)[None, :] < K, other=0.0)
            w = tl.load(w_ptrs, mask=(k0 + rk)[:, None] < K, other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K * sxk
        w_ptrs += BLOCK_K * swk
    return acc


@triton.jit
def _mm_sum(
    x_ptr, w_ptr, M, N, K, sxm, sxk, swn, swk, pid_m, pid_n, pid_s,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_K: tl.constexpr,
):  # fmt: skip
    """The fp32 tile x[rm] @ w[rn].T of program (pid_m, pid_n) in the one K order every matmul here has: chunk
    partials p_s over K in CHUNK_K pieces (``_mm_chunk``), total = ((p0 + p1) + p2) + ... Fused (SPLIT False): the
    whole total, the chunks in a loop. SPLIT: only p_{pid_s}, which the caller stores for ``matmul_reduce_kernel`` to
    add in the same order; each chunk runs the same loop on the same tile either way, so the partials are the same
    bits."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SPLIT:  # this program's chunk only
        k_lo = pid_s * CHUNK_K
    else:  # the first chunk, then the others in order
        k_lo = 0
    acc = _mm_chunk(
        x_ptr, w_ptr, M, N, K, sxm, sxk, swn, swk, rm, rn, k_lo, tl.minimum(k_lo + CHUNK_K, K),
        UPCAST, IEEE, EVEN_K, BLOCK_K, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    if not SPLIT:
        for c0 in range(CHUNK_K, K, CHUNK_K):
            acc = acc + _mm_chunk(
                x_ptr, w_ptr, M, N, K, sxm, sxk, swn, swk, rm, rn, c0, tl.minimum(c0 + CHUNK_K, K),
                UPCAST, IEEE, EVEN_K, BLOCK_K, BLOCK_M, BLOCK_N,
            )  # fmt: skip
    return acc, rm, rn


@triton.jit
def _mm_epilogue(acc, col, col_ok, b_ptr, res_ptrs, mask, out_ptr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """The matmul's output from its fp32 sum: + b[col], one rounding to out_ptr's dtype; with HAS_RES, + res rounded
    again (torch's ``res + linear(x)``: two roundings). The fused and the reduce kernel both end here."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_RES:
        res = tl.load(res_ptrs, mask=mask, other=0.0)
        out = (out.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)
    return out


@triton.jit(do_not_specialize=["M"])
def matmul_kernel(
    x_ptr, w_ptr, b_ptr, res_ptr, out_ptr, ws_ptr, M, N, K, sxm, sxk, swn, swk, srm, som, son,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNK_K: tl.constexpr,
):  # fmt: skip
    """out[M, N] = x[M, K] @ w[N, K].T (+ b[N]) summed in ``_mm_sum``'s order, rounded once; with HAS_RES, then
    + res[M, N] rounded again. Program (M tile, N tile). SPLIT: program (M tile, N tile, chunk s) stores only its
    chunk's fp32 partial into ws [S, M, N] (contiguous); ``matmul_reduce_kernel`` finishes. Rows and columns past the
    edges are not stored."""
    acc, rm, rn = _mm_sum(
        x_ptr, w_ptr, M, N, K, sxm, sxk, swn, swk, tl.program_id(0), tl.program_id(1), tl.program_id(2),
        SPLIT, UPCAST, IEEE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, CHUNK_K,
    )  # fmt: skip
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT:
        ws_ptr += tl.program_id(2).to(tl.int64) * M * N
        tl.store(ws_ptr + rm[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        out = _mm_epilogue(
            acc, rn[None, :], (rn < N)[None, :], b_ptr, res_ptr + rm[:, None] * srm + rn[None, :], mask, out_ptr,
            HAS_BIAS, HAS_RES,
        )  # fmt: skip
        tl.store(out_ptr + rm[:, None] * som + rn[None, :] * son, out, mask=mask)


@triton.jit(do_not_specialize=["M"])
def matmul_segments_kernel(
    x_ptr, w0_ptr, w1_ptr, w2_ptr, o0_ptr, o1_ptr, o2_ptr, ws_ptr, M, N0, N1, N2, K, sxm, sxk, sw0, sw1, sw2, swk,
    NSEG: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_K: tl.constexpr,
):  # fmt: skip
    """x @ w_i.T for NSEG (2 or 3) weights of one input in one launch (q/k/v, gate/up): the N tiles of w0, then
    w1's, then w2's along program axis 1, each output o_i [M, N_i] contiguous, no bias (N2 0 when NSEG is 2). A
    tile's sum is ``_mm_sum``'s, as in ``matmul_kernel``: more programs a launch and fewer launches, the same sums.
    SPLIT: chunk partials into ws [S, M, N0 + N1 + N2] (segment i's columns after those of the ones before it) for
    ``matmul_reduce_kernel``."""
    pid = tl.program_id(1)
    t0 = tl.cdiv(N0, BLOCK_N)
    t1 = tl.cdiv(N1, BLOCK_N)
    w_ptr, o_ptr, N, swn, pid_n, c0 = w0_ptr, o0_ptr, N0, sw0, pid, 0
    if pid >= t0:
        w_ptr, o_ptr, N, swn, pid_n, c0 = w1_ptr, o1_ptr, N1, sw1, pid - t0, N0
    if NSEG == 3:
        if pid >= t0 + t1:
            w_ptr, o_ptr, N, swn, pid_n, c0 = w2_ptr, o2_ptr, N2, sw2, pid - t0 - t1, N0 + N1
    acc, rm, rn = _mm_sum(
        x_ptr, w_ptr, M, N, K, sxm, sxk, swn, swk, tl.program_id(0), pid_n, tl.program_id(2),
        SPLIT, UPCAST, IEEE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, CHUNK_K,
    )  # fmt: skip
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT:
        NT = N0 + N1 + N2
        ws_ptr += tl.program_id(2).to(tl.int64) * M * NT
        tl.store(ws_ptr + rm[:, None] * NT + (c0 + rn)[None, :], acc, mask=mask)
    else:
        tl.store(o_ptr + rm[:, None] * N + rn[None, :], acc.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def matmul_reduce_kernel(
    ws_ptr, b_ptr, res_ptr, o0_ptr, o1_ptr, o2_ptr, M, N0, N1, N2, S, srm,
    NSEG: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The second half of a SPLIT matmul: total = ((p0 + p1) + p2) + ... of the S chunk partials ws [S, M, NT]
    (NT = N0 + N1 + N2) in chunk order, then ``_mm_epilogue`` (bias / residual: NSEG 1 only), as the fused program
    would. Element-wise over BLOCK flat (row, column) indices; column c of a row goes to o0 [M, N0] (c < N0), o1
    [M, N1] or o2 [M, N2], each contiguous."""
    NT = N0 + N1 + N2
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < M * NT
    row, col = idx // NT, idx % NT
    p_ptrs = ws_ptr + idx
    acc = tl.load(p_ptrs, mask=ok, other=0.0)
    for _ in range(1, S):
        p_ptrs += M * NT
        acc = acc + tl.load(p_ptrs, mask=ok, other=0.0)
    if NSEG == 1:
        out = _mm_epilogue(acc, col, ok, b_ptr, res_ptr + row * srm + col, ok, o0_ptr, HAS_BIAS, HAS_RES)
        tl.store(o0_ptr + row * N0 + col, out, mask=ok)
    else:
        out = acc.to(o0_ptr.dtype.element_ty)
        tl.store(o0_ptr + row * N0 + col, out, mask=ok & (col < N0))
        tl.store(o1_ptr + row * N1 + (col - N0), out, mask=ok & (col >= N0) & (col < N0 + N1))
        if NSEG == 3:
            tl.store(o2_ptr + row * N2 + (col - N0 - N1), out, mask=ok & (col >= N0 + N1))


@triton.jit(do_not_specialize=["R"])
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, R, D, sx, so, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """HF's RMSNorm per row: y = (x * rsqrt(mean(x^2) + eps)) rounded to x's dtype, then w * y rounded."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < R) & (cols[None, :] < D)
    x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=1) / D
    y = (x * (1.0 / tl.sqrt(ms + eps))[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * so + cols[None, :], (w[None, :] * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R"])
def rms_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, R, H, D, sx, so, sc, eps,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Per row (one head of one token): ``rms_norm_kernel``'s output y, then RoPE at the token's position as torch's
    ``y * cos + rotate_half(y) * sin`` rounds it (each product, then the sum). Row r belongs to token r // H, at
    position pos[r // H]; the rotate-half partner of column d is recomputed from x (the same ops, the same bits)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    half = D // 2
    row_ok = rows < R
    mask = row_ok[:, None] & (cols[None, :] < D)
    partner = tl.where(cols < half, cols + half, cols - half)
    x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + rows[:, None] * sx + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    dt = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=cols < D, other=0.0).to(tl.float32)
    y = (w[None, :] * (x * inv[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    yp = (wp[None, :] * (xp * inv[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    rh = tl.where(cols[None, :] < half, -yp, yp)
    pos = tl.load(pos_ptr + rows // H, mask=row_ok, other=0)
    c = tl.load(cos_ptr + pos[:, None] * sc + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + pos[:, None] * sc + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = (y * c).to(dt).to(tl.float32) + (rh * sn).to(dt).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * so + cols[None, :], out.to(dt), mask=mask)


@triton.jit(do_not_specialize=["R"])
def silu_mul_kernel(g_ptr, u_ptr, out_ptr, R, C, sg, su, so, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """silu(g) rounded to the dtype, times u, rounded (HF's ``F.silu(gate) * up`` in the model dtype)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    g = tl.load(g_ptr + rows[:, None] * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * su + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * so + cols[None, :], (s * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["B", "Tq"])
def attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, start_ptr, B, Tq, G, Dh, scale,
    sqb, sqt, sqh, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, sot, soh, sod,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Causal attention of query token t of row b (position start[b] + t) over keys [0, position] of row b, in blocks
    of BLOCK_N positions from 0 with an online softmax. Program (b, kv head, token block); tile rows are
    (token, head of the group) pairs. Blocks past a row's position (other rows of the tile reach them) leave it
    bit-unchanged: max unchanged, rescale exp(0) = 1, weights exp(-inf) = 0."""
    b, kvh, tb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = tl.arange(0, BLOCK_T * BLOCK_G)
    t = tb * BLOCK_T + r // BLOCK_G
    g = r % BLOCK_G
    row_ok = (t < Tq) & (g < G)
    start = tl.load(start_ptr + b)
    pos = tl.where(row_ok, start + t, 0)  # dead rows attend key 0: no NaN
    d = tl.arange(0, BLOCK_D)
    d_ok = d < Dh
    head = kvh * G + g
    q = tl.load(
        q_ptr + b * sqb + t[:, None] * sqt + head[:, None] * sqh + d[None, :] * sqd,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_T * BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_T * BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_T * BLOCK_G, BLOCK_D), tl.float32)
    hi = tl.max(pos, axis=0) + 1
    for n0 in range(0, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        kv_ok = (n[None, :] < hi) & d_ok[:, None]
        k = tl.load(k_ptr + b * skb + kvh * skh + n[None, :] * skt + d[:, None] * skd, mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + b * svb + kvh * svh + n[:, None] * svt + d[None, :] * svd, mask=kv_ok.T, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee") * scale
        else:
            s = tl.dot(q, k) * scale
        s = tl.where(n[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        p = p.to(v.dtype)
        if UPCAST:
            p, v = p.to(tl.float32), v.to(tl.float32)
        if IEEE:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p, v, acc)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + b * sob + t[:, None] * sot + head[:, None] * soh + d[None, :] * sod,
        out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )  # fmt: skip


@triton.jit(do_not_specialize=["R"])
def logprob_kernel(
    logits_ptr, temp_ptr, target_ptr, lp_ptr, ent_ptr, R, V, sl, BLOCK_V: tl.constexpr
):  # fmt: skip
    """Per row of fp32 logits: x = logits / temperature; log_softmax(x)[target] and the entropy, with the running max
    and sums carried over vocab chunks of BLOCK_V from index 0."""
    row = tl.program_id(0)
    temp = tl.load(temp_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    m = tl.max(tl.full((BLOCK_V,), float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros((BLOCK_V,), tl.float32), axis=0)
    sx = tl.sum(tl.zeros((BLOCK_V,), tl.float32), axis=0)
    for v0 in range(0, V, BLOCK_V):
        ok = v0 + cols < V
        x = tl.load(logits_ptr + row * sl + v0 + cols, mask=ok, other=float("-inf")) / temp
        m_new = tl.maximum(m, tl.max(x, axis=0))
        a = tl.exp(m - m_new)
        e = tl.exp(x - m_new)
        s = s * a + tl.sum(e, axis=0)
        sx = sx * a + tl.sum(tl.where(ok, e * x, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    tgt = tl.load(target_ptr + row)
    x_t = tl.load(logits_ptr + row * sl + tgt) / temp
    tl.store(lp_ptr + row, x_t - lse)
    tl.store(ent_ptr + row, lse - sx / s)
