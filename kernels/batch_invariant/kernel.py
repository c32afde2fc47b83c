"""Batch-invariant Triton kernels: every output row is reduced in an order fixed by the tile constants below, never
by how many rows, tokens or sequences a launch holds (no split-K, no split-KV, no shape-dependent config).

What makes a row's value independent of the launch: one tile shape per kernel (constants, not autotuned), the
reduction dims (K of a matmul, D of a norm, KV positions of attention, V of the log-softmax) walked in fixed blocks
from index 0 in one order, and no argument specialization that could pick another instruction (``do_not_specialize``
on the row counts). Rows that share a tile are independent in ``tl.dot`` and in row reductions.

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
# 16 programs instead of 8). On the H100 the exact engine decodes at 0.20x the default's tokens/s at batch 1
# (docs/benchmarks.md): PRIME_SPMD_EXACT_MM_BLOCK_N (16, 32, 64, 128) sets BLOCK_N for `gpu_suite.sh exact OUT tiles`
# to measure narrower tiles (more programs); each output still sums K in the same BLOCK_K steps. The trainer and the
# engine must run with the same value (one process, or the same environment on every rank).
MM_BLOCK_M, MM_BLOCK_K = 64, 64
MM_BLOCK_N = int(os.environ.get("PRIME_SPMD_EXACT_MM_BLOCK_N", "64"))
if MM_BLOCK_N not in (16, 32, 64, 128):
    raise ValueError(f"PRIME_SPMD_EXACT_MM_BLOCK_N={MM_BLOCK_N}: choose 16, 32, 64 or 128")
MM_WARPS, MM_STAGES = 4, 3
# elements per program of the row-wise kernels (norm, SiLU-gate): rows per program = ROW_ELEMS // the padded row
# length, a function of the row length only
ROW_ELEMS = 4096
# attention: BLOCK_T query tokens x BLOCK_G heads of one kv head per program, KV walked in BLOCK_N positions
ATTN_BLOCK_T, ATTN_BLOCK_N = 16, 64
# log-softmax: the vocab walked in chunks of LOGPROB_BLOCK_V
LOGPROB_BLOCK_V = 2048


@triton.jit
def _mm_acc(
    x_ptr, w_ptr, M, N, K, sxm, sxk, swn, swk, pid_m, pid_n,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The fp32 tile x[rm] @ w[rn].T of program (pid_m, pid_n), summed over K in BLOCK_K steps from 0: the one
    reduction every matmul here runs. Rows and columns past the edges read rows M - ... again (index modulo M, N:
    unmasked loads the loop can pipeline); EVEN_K (K % BLOCK_K == 0, a property of the weight) drops the K mask."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (rm % M)[:, None] * sxm + rk[None, :] * sxk
    w_ptrs = w_ptr + (rn % N)[None, :] * swn + rk[:, None] * swk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
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
    return acc, rm, rn


@triton.jit(do_not_specialize=["M"])
def matmul_kernel(
    x_ptr, w_ptr, b_ptr, res_ptr, out_ptr, M, N, K, sxm, sxk, swn, swk, srm, som, son,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[M, N] = x[M, K] @ w[N, K].T (+ b[N]), fp32 accumulation over K in BLOCK_K steps from 0 (``_mm_acc``),
    rounded once; with HAS_RES, then + res[M, N] rounded again (torch's ``res + linear(x)``: two roundings). Rows and
    columns past the edges are not stored."""
    acc, rm, rn = _mm_acc(
        x_ptr, w_ptr, M, N, K, sxm, sxk, swn, swk, tl.program_id(0), tl.program_id(1),
        UPCAST, IEEE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_RES:
        res = tl.load(res_ptr + rm[:, None] * srm + rn[None, :], mask=mask, other=0.0)
        out = (out.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None] * som + rn[None, :] * son, out, mask=mask)


@triton.jit(do_not_specialize=["M"])
def matmul_segments_kernel(
    x_ptr, w0_ptr, w1_ptr, w2_ptr, o0_ptr, o1_ptr, o2_ptr, M, N0, N1, N2, K, sxm, sxk, sw0, sw1, sw2, swk,
    NSEG: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """x @ w_i.T for NSEG (2 or 3) weights of one input in one launch (q/k/v, gate/up): the N tiles of w0, then
    w1's, then w2's along program axis 1, each output o_i [M, N_i] contiguous, no bias. A tile's reduction is
    ``_mm_acc``'s, as in ``matmul_kernel``: more programs a launch and fewer launches, the same sums."""
    pid = tl.program_id(1)
    t0 = tl.cdiv(N0, BLOCK_N)
    t1 = tl.cdiv(N1, BLOCK_N)
    w_ptr, o_ptr, N, swn, pid_n = w0_ptr, o0_ptr, N0, sw0, pid
    if pid >= t0:
        w_ptr, o_ptr, N, swn, pid_n = w1_ptr, o1_ptr, N1, sw1, pid - t0
    if NSEG == 3:
        if pid >= t0 + t1:
            w_ptr, o_ptr, N, swn, pid_n = w2_ptr, o2_ptr, N2, sw2, pid - t0 - t1
    acc, rm, rn = _mm_acc(
        x_ptr, w_ptr, M, N, K, sxm, sxk, swn, swk, tl.program_id(0), pid_n, UPCAST, IEEE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K
    )  # fmt: skip
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(o_ptr + rm[:, None] * N + rn[None, :], acc.to(o_ptr.dtype.element_ty), mask=mask)


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
