"""Triton kernels for the fused LM-head logprob + entropy.

Forward (`_fwd_kernel`): each program owns BLOCK_N tokens and one slice of the vocabulary; it walks the
slice in BLOCK_V columns, computes the logits tile with a K-loop over H (fp32 accumulation), and keeps an
online logsumexp: running max m, s = sum exp(z - m), a = sum exp(z - m) * z, and the target logit.
Slices are combined in `forward` (a few [splits, N] tensors). Nothing of size N * V is ever stored.

Backward (`_grad_logits_kernel`): for one chunk of tokens, recompute the logits tile by tile and write
d loss / d logits (input dtype) into a [chunk, V] buffer; `backward` then runs the two gradient matmuls
(d hidden = G @ W, d weight += G^T @ h) with cuBLAS. Peak extra memory is chunk * V, set by a budget and
independent of N.

CPU: under TRITON_INTERPRET=1 bf16 tl.dot gives wrong results, so tiles are upcast to fp32 there, and
autotune with several configs fails there, so one fixed config is launched. On CUDA both kernels autotune.

Shape legend: N tokens, H hidden size, V vocabulary size, S vocabulary slices, C tokens in a chunk.
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Elements of the backward's [chunk, V] gradient buffer: 2**29 is 1 GiB in bf16 (3456 tokens at V=151936).
GRAD_BUFFER_ELEMENTS = 2**29


@triton.jit
def _logits_tile(
    h_ptr,
    w_ptr,
    offs_n,
    offs_v,
    mask_n,
    mask_v,
    H,
    stride_hn,
    stride_wv,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """fp32 [BLOCK_N, BLOCK_V] tile of hidden @ weight.T (rows offs_n, vocab columns offs_v).

    Row offsets go to int64 first: V * H passes 2**31 for large vocabularies with H >= 8192.
    """
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    h_rows = h_ptr + offs_n.to(tl.int64)[:, None] * stride_hn
    w_rows = w_ptr + offs_v.to(tl.int64)[None, :] * stride_wv
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # Without a mask along K Triton (3.9, sm_90) pipelines these loads; with one it does not.
        if EVEN_K:
            h = tl.load(h_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
            w = tl.load(w_rows + offs_k[:, None], mask=mask_v[None, :], other=0.0)
        else:
            mask_k = offs_k < H
            h = tl.load(h_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[:, None], mask=mask_v[None, :] & mask_k[:, None], other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _fwd_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    temp_ptr,
    m_ptr,
    s_ptr,
    a_ptr,
    zt_ptr,
    N,
    H,
    V,
    stride_hn,
    stride_wv,
    v_per_split,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    tgt = tl.load(tgt_ptr + offs_n, mask=mask_n, other=-1)
    inv_t = 1.0 / tl.load(temp_ptr + offs_n, mask=mask_n, other=1.0)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    zt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    v_start = pid_s * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < v_end
        z = (
            _logits_tile(
                h_ptr,
                w_ptr,
                offs_n,
                offs_v,
                mask_n,
                mask_v,
                H,
                stride_hn,
                stride_wv,
                BLOCK_N,
                BLOCK_V,
                BLOCK_K,
                EVEN_K,
                UPCAST,
                PRECISION,
            )
            * inv_t[:, None]
        )
        z_masked = tl.where(mask_v[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_masked, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(z_masked - m_new[:, None])
        s = s * alpha + tl.sum(p, axis=1)
        a = a * alpha + tl.sum(p * tl.where(mask_v[None, :], z, 0.0), axis=1)
        zt += tl.sum(tl.where(offs_v[None, :] == tgt[:, None], z, 0.0), axis=1)
        m = m_new
    out = pid_s * N + offs_n
    tl.store(m_ptr + out, m, mask=mask_n)
    tl.store(s_ptr + out, s, mask=mask_n)
    tl.store(a_ptr + out, a, mask=mask_n)
    tl.store(zt_ptr + out, zt, mask=mask_n)


@triton.jit
def _grad_logits_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    temp_ptr,
    lse_ptr,
    ent_ptr,
    glp_ptr,
    gent_ptr,
    g_ptr,
    N,
    H,
    V,
    stride_hn,
    stride_wv,
    stride_gn,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Grouped program order so that GROUP_N row blocks share weight tiles in L2.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_v = tl.cdiv(V, BLOCK_V)
    group = pid // (GROUP_N * num_pid_v)
    first_n = group * GROUP_N
    group_size = tl.minimum(num_pid_n - first_n, GROUP_N)
    pid_n = first_n + (pid % (GROUP_N * num_pid_v)) % group_size
    pid_v = (pid % (GROUP_N * num_pid_v)) // group_size

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_n = offs_n < N
    mask_v = offs_v < V
    inv_t = 1.0 / tl.load(temp_ptr + offs_n, mask=mask_n, other=1.0)
    lse = tl.load(lse_ptr + offs_n, mask=mask_n, other=0.0)
    z = (
        _logits_tile(
            h_ptr,
            w_ptr,
            offs_n,
            offs_v,
            mask_n,
            mask_v,
            H,
            stride_hn,
            stride_wv,
            BLOCK_N,
            BLOCK_V,
            BLOCK_K,
            EVEN_K,
            UPCAST,
            PRECISION,
        )
        * inv_t[:, None]
    )
    p = tl.exp(z - lse[:, None])
    g = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if HAS_GLP:
        glp = tl.load(glp_ptr + offs_n, mask=mask_n, other=0.0)
        tgt = tl.load(tgt_ptr + offs_n, mask=mask_n, other=-1)
        onehot = (offs_v[None, :] == tgt[:, None]).to(tl.float32)
        g += glp[:, None] * (onehot - p)
    if HAS_GENT:
        gent = tl.load(gent_ptr + offs_n, mask=mask_n, other=0.0)
        expected = lse - tl.load(ent_ptr + offs_n, mask=mask_n, other=0.0)
        g += gent[:, None] * p * (expected[:, None] - z)
    g = g * inv_t[:, None]  # d z / d raw logits = 1 / T
    tl.store(
        g_ptr + offs_n.to(tl.int64)[:, None] * stride_gn + offs_v[None, :],
        g.to(g_ptr.dtype.element_ty),
        mask=mask_n[:, None] & mask_v[None, :],
    )


def _empty(shape: tuple[int, ...], like: Tensor, dtype: torch.dtype) -> Tensor:
    """Every output and scratch buffer comes from here, so tests can poison them (NaN-fill)."""
    return torch.empty(shape, device=like.device, dtype=dtype)


def _cuda_configs() -> list[triton.Config]:
    # Hopper-sized tiles; the tuner picks per (N, H, V, dtype) bucket.
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bn, bv, bk, w, st in [
            (128, 128, 64, 8, 4),
            (128, 256, 64, 8, 3),
            (128, 128, 64, 4, 4),
            (64, 256, 64, 8, 4),
            (128, 64, 64, 4, 4),
            (64, 128, 128, 4, 3),
        ]
    ]


_KEY = ["N", "H", "V"]
_EVEN_K = triton.heuristics({"EVEN_K": lambda args: args["H"] % args["BLOCK_K"] == 0})
_fwd_tuned = triton.autotune(_cuda_configs(), key=_KEY)(_EVEN_K(_fwd_kernel))
_grad_tuned = triton.autotune(_cuda_configs(), key=_KEY)(_EVEN_K(_grad_logits_kernel))
# One fixed config for the CPU interpreter (small tiles keep it fast; 16 is tl.dot's minimum).
_CPU_META = {"BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_K": 32}


def _grad_grid(meta: dict) -> tuple[int]:
    return (triton.cdiv(meta["N"], meta["BLOCK_N"]) * triton.cdiv(meta["V"], meta["BLOCK_V"]),)


def _dot_options(hidden_NH: Tensor) -> dict:
    upcast = _INTERPRET or hidden_NH.device.type != "cuda"
    # fp32 inputs must not silently run in TF32: the fp32 path is held to 1e-4.
    precision = "ieee" if hidden_NH.dtype == torch.float32 else "tf32"
    return {"UPCAST": upcast, "PRECISION": precision}


def _num_vocab_splits(num_tokens: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(splits, vocab columns per split): enough programs to fill the GPU when N is small."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        row_blocks = triton.cdiv(num_tokens, 128)
        splits = max(1, min(triton.cdiv(2 * sms, row_blocks), triton.cdiv(vocab, 4096)))
    else:
        splits = triton.cdiv(vocab, 128)  # several slices even at test sizes, to test the combine
    # A multiple of 256 so that every BLOCK_V divides it; no slice is empty.
    per_split = triton.cdiv(triton.cdiv(vocab, splits), 256) * 256
    return triton.cdiv(vocab, per_split), per_split


def forward(hidden_NH: Tensor, weight_VH: Tensor, targets_N: Tensor, temperature_N: Tensor) -> tuple[Tensor, ...]:
    """Fused forward: returns fp32 [N] logprob, entropy and logsumexp (of logits / T)."""
    num_tokens, hidden_size = hidden_NH.shape
    vocab = weight_VH.shape[0]
    splits, per_split = _num_vocab_splits(num_tokens, vocab, hidden_NH.device)
    parts_SN = _empty((4, splits, num_tokens), hidden_NH, torch.float32)
    m_SN, s_SN, a_SN, zt_SN = parts_SN.unbind(0)
    args = (
        hidden_NH,
        weight_VH,
        targets_N,
        temperature_N,
        m_SN,
        s_SN,
        a_SN,
        zt_SN,
        num_tokens,
        hidden_size,
        vocab,
        hidden_NH.stride(0),
        weight_VH.stride(0),
        per_split,
    )
    opts = _dot_options(hidden_NH)
    if opts["UPCAST"]:
        grid = (triton.cdiv(num_tokens, _CPU_META["BLOCK_N"]), splits)
        _fwd_kernel[grid](*args, **_CPU_META, EVEN_K=hidden_size % _CPU_META["BLOCK_K"] == 0, **opts)
    else:
        _fwd_tuned[lambda meta: (triton.cdiv(num_tokens, meta["BLOCK_N"]), splits)](*args, **opts)
    m_N = m_SN.max(dim=0).values
    scale_SN = torch.exp(m_SN - m_N)
    s_N = (s_SN * scale_SN).sum(0)
    lse_N = m_N + torch.log(s_N)
    entropy_N = lse_N - (a_SN * scale_SN).sum(0) / s_N
    logprob_N = zt_SN.sum(0) - lse_N
    return logprob_N, entropy_N, lse_N


def backward(
    grad_logprob_N: Tensor | None,
    grad_entropy_N: Tensor | None,
    hidden_NH: Tensor,
    weight_VH: Tensor,
    targets_N: Tensor,
    temperature_N: Tensor,
    lse_N: Tensor,
    entropy_N: Tensor,
    grad_buffer_elements: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(d hidden [N, H], d weight [V, H]) in the input dtype; recomputes logits chunk by chunk.

    grad_buffer_elements caps the [chunk, V] scratch buffer (default GRAD_BUFFER_ELEMENTS).
    """
    num_tokens, hidden_size = hidden_NH.shape
    vocab = weight_VH.shape[0]
    if grad_logprob_N is None and grad_entropy_N is None:
        return torch.zeros_like(hidden_NH), torch.zeros_like(weight_VH)
    grad_hidden_NH = _empty(tuple(hidden_NH.shape), hidden_NH, hidden_NH.dtype)
    grad_weight_VH = _empty(tuple(weight_VH.shape), weight_VH, weight_VH.dtype)
    budget = GRAD_BUFFER_ELEMENTS if grad_buffer_elements is None else grad_buffer_elements
    chunk = max(1, min(num_tokens, budget // vocab))
    if chunk >= 128:
        chunk -= chunk % 128
    grad_CV = _empty((chunk, vocab), hidden_NH, hidden_NH.dtype)
    opts = _dot_options(hidden_NH)
    dummy = lse_N  # placeholder pointer for an absent upstream gradient (never read)
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        rows = end - start
        grad_cv = grad_CV[:rows]
        args = (
            hidden_NH[start:end],
            weight_VH,
            targets_N[start:end],
            temperature_N[start:end],
            lse_N[start:end],
            entropy_N[start:end],
            dummy if grad_logprob_N is None else grad_logprob_N[start:end],
            dummy if grad_entropy_N is None else grad_entropy_N[start:end],
            grad_cv,
            rows,
            hidden_size,
            vocab,
            hidden_NH.stride(0),
            weight_VH.stride(0),
            grad_cv.stride(0),
        )
        flags = {"HAS_GLP": grad_logprob_N is not None, "HAS_GENT": grad_entropy_N is not None, "GROUP_N": 8}
        if opts["UPCAST"]:
            grid = (triton.cdiv(rows, _CPU_META["BLOCK_N"]) * triton.cdiv(vocab, _CPU_META["BLOCK_V"]),)
            even_k = hidden_size % _CPU_META["BLOCK_K"] == 0
            _grad_logits_kernel[grid](*args, **flags, **_CPU_META, EVEN_K=even_k, **opts)
        else:
            _grad_tuned[_grad_grid](*args, **flags, **opts)
        torch.mm(grad_cv, weight_VH, out=grad_hidden_NH[start:end])
        if start == 0:
            torch.mm(grad_cv.T, hidden_NH[start:end], out=grad_weight_VH)
        else:  # beta=1 accumulation in the weight dtype: one rounding per chunk (see README).
            grad_weight_VH.addmm_(grad_cv.T, hidden_NH[start:end])
    return grad_hidden_NH, grad_weight_VH
