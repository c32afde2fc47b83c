"""Triton kernels for the fused LM-head logprob + entropy.

Forward (`_fwd_kernel`): each program owns BLOCK_T tokens and one slice of the vocabulary; it walks the
slice in BLOCK_V columns, computes the logits tile with a loop over D in BLOCK_D steps (fp32 accumulation),
and keeps an online logsumexp: running max m, s = sum exp(z - m), a = sum exp(z - m) * z, and the target logit.
Slices are combined in `forward` (a few [splits, T] tensors). Nothing of size T * V is ever stored.

Backward (`_grad_logits_kernel`): for one chunk of tokens, recompute the logits tile by tile and write
d loss / d logits (input dtype) into a [chunk, V] buffer; `backward` then runs the two gradient matmuls
(d hidden = G @ W, d weight += G^T @ h) with cuBLAS. Peak extra memory is chunk * V, set by a budget and
independent of T.

CPU: under TRITON_INTERPRET=1 bf16 tl.dot gives wrong results, so tiles are upcast to fp32 there, and
autotune with several configs fails there, so one fixed config is launched. On CUDA both kernels autotune.

Shape legend (docs/conventions.md): T tokens, D hidden size, V vocabulary size, C tokens in a chunk; local letter
of this file: Vs vocabulary slices (the forward's split of V over programs). Kernel scalars T, D, V and tiles
BLOCK_T, BLOCK_V, BLOCK_D (GROUP_T row blocks per L2 group) use the same letters.
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
    offs_t,
    offs_v,
    mask_t,
    mask_v,
    D,
    stride_ht,
    stride_wv,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """fp32 [BLOCK_T, BLOCK_V] tile of hidden @ weight.T (rows offs_t, vocab columns offs_v).

    Row offsets go to int64 first: V * D passes 2**31 for large vocabularies with D >= 8192.
    """
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    h_rows = h_ptr + offs_t.to(tl.int64)[:, None] * stride_ht
    w_rows = w_ptr + offs_v.to(tl.int64)[None, :] * stride_wv
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        # Without a mask along D Triton (3.9, sm_90) pipelines these loads; with one it does not.
        if EVEN_D:
            h = tl.load(h_rows + offs_d[None, :], mask=mask_t[:, None], other=0.0)
            w = tl.load(w_rows + offs_d[:, None], mask=mask_v[None, :], other=0.0)
        else:
            mask_d = offs_d < D
            h = tl.load(h_rows + offs_d[None, :], mask=mask_t[:, None] & mask_d[None, :], other=0.0)
            w = tl.load(w_rows + offs_d[:, None], mask=mask_v[None, :] & mask_d[:, None], other=0.0)
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
    T,
    D,
    V,
    T_BUCKET,
    stride_ht,
    stride_wv,
    v_per_split,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    tgt = tl.load(tgt_ptr + offs_t, mask=mask_t, other=-1)
    inv_temp = 1.0 / tl.load(temp_ptr + offs_t, mask=mask_t, other=1.0)
    m = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_T,), dtype=tl.float32)
    a = tl.zeros((BLOCK_T,), dtype=tl.float32)
    zt = tl.zeros((BLOCK_T,), dtype=tl.float32)
    v_start = pid_s * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < v_end
        z = (
            _logits_tile(
                h_ptr,
                w_ptr,
                offs_t,
                offs_v,
                mask_t,
                mask_v,
                D,
                stride_ht,
                stride_wv,
                BLOCK_T,
                BLOCK_V,
                BLOCK_D,
                EVEN_D,
                UPCAST,
                PRECISION,
            )
            * inv_temp[:, None]
        )
        z_masked = tl.where(mask_v[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_masked, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(z_masked - m_new[:, None])
        s = s * alpha + tl.sum(p, axis=1)
        a = a * alpha + tl.sum(p * tl.where(mask_v[None, :], z, 0.0), axis=1)
        zt += tl.sum(tl.where(offs_v[None, :] == tgt[:, None], z, 0.0), axis=1)
        m = m_new
    out = pid_s * T + offs_t
    tl.store(m_ptr + out, m, mask=mask_t)
    tl.store(s_ptr + out, s, mask=mask_t)
    tl.store(a_ptr + out, a, mask=mask_t)
    tl.store(zt_ptr + out, zt, mask=mask_t)


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
    T,
    D,
    V,
    T_BUCKET,
    stride_ht,
    stride_wv,
    stride_gt,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    GROUP_T: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Grouped program order so that GROUP_T row blocks share weight tiles in L2.
    pid = tl.program_id(0)
    num_pid_t = tl.cdiv(T, BLOCK_T)
    num_pid_v = tl.cdiv(V, BLOCK_V)
    group = pid // (GROUP_T * num_pid_v)
    first_t = group * GROUP_T
    group_size = tl.minimum(num_pid_t - first_t, GROUP_T)
    pid_t = first_t + (pid % (GROUP_T * num_pid_v)) % group_size
    pid_v = (pid % (GROUP_T * num_pid_v)) // group_size

    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_t = offs_t < T
    mask_v = offs_v < V
    inv_temp = 1.0 / tl.load(temp_ptr + offs_t, mask=mask_t, other=1.0)
    lse = tl.load(lse_ptr + offs_t, mask=mask_t, other=0.0)
    z = (
        _logits_tile(
            h_ptr,
            w_ptr,
            offs_t,
            offs_v,
            mask_t,
            mask_v,
            D,
            stride_ht,
            stride_wv,
            BLOCK_T,
            BLOCK_V,
            BLOCK_D,
            EVEN_D,
            UPCAST,
            PRECISION,
        )
        * inv_temp[:, None]
    )
    p = tl.exp(z - lse[:, None])
    g = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    if HAS_GLP:
        glp = tl.load(glp_ptr + offs_t, mask=mask_t, other=0.0)
        tgt = tl.load(tgt_ptr + offs_t, mask=mask_t, other=-1)
        onehot = (offs_v[None, :] == tgt[:, None]).to(tl.float32)
        g += glp[:, None] * (onehot - p)
    if HAS_GENT:
        gent = tl.load(gent_ptr + offs_t, mask=mask_t, other=0.0)
        expected = lse - tl.load(ent_ptr + offs_t, mask=mask_t, other=0.0)
        g += gent[:, None] * p * (expected[:, None] - z)
    g = g * inv_temp[:, None]  # d z / d raw logits = 1 / temperature
    tl.store(
        g_ptr + offs_t.to(tl.int64)[:, None] * stride_gt + offs_v[None, :],
        g.to(g_ptr.dtype.element_ty),
        mask=mask_t[:, None] & mask_v[None, :],
    )


def _empty(shape: tuple[int, ...], like: Tensor, dtype: torch.dtype) -> Tensor:
    """Every output and scratch buffer comes from here, so tests can poison them (NaN-fill)."""
    return torch.empty(shape, device=like.device, dtype=dtype)


def _cuda_configs() -> list[triton.Config]:
    # Hopper-sized tiles; the tuner picks per (T, D, V, dtype) bucket.
    return [
        triton.Config({"BLOCK_T": bt, "BLOCK_V": bv, "BLOCK_D": bd}, num_warps=w, num_stages=st)
        for bt, bv, bd, w, st in [
            (128, 128, 64, 8, 4),
            (128, 256, 64, 8, 3),
            (128, 128, 64, 4, 4),
            (64, 256, 64, 8, 4),
            (128, 64, 64, 4, 4),
            (64, 128, 128, 4, 3),
        ]
    ]


# keyed on a power-of-two bucket of T (T_BUCKET, unused in the kernels), not on T: RL micro-batches vary T every
# step, and each new key would re-run the tuner (exact mode's LM-head backward retuned every step: 10x a step)
_KEY = ["T_BUCKET", "D", "V"]
TUNE_BUCKET_CAP = 1024
"""Token counts past this share one tuner key: their grids fill the GPU whatever the tile. At 4b65079 (H100,
uncapped) counts on either side of 2048 still retuned inside a timed run: exact mode's trainer steps of ~1 s (0.24 s
steady), and 6,112 backward launches and 4,891 cache flushes in its two profiled steps."""


def t_bucket(num_tokens: int) -> int:
    """The tuner's T_BUCKET of ``num_tokens``: the next power of two, at most ``TUNE_BUCKET_CAP``."""
    return min(triton.next_power_of_2(num_tokens), TUNE_BUCKET_CAP)


_EVEN_D = triton.heuristics({"EVEN_D": lambda args: args["D"] % args["BLOCK_D"] == 0})
_fwd_tuned = triton.autotune(_cuda_configs(), key=_KEY)(_EVEN_D(_fwd_kernel))
_grad_tuned = triton.autotune(_cuda_configs(), key=_KEY)(_EVEN_D(_grad_logits_kernel))
# One fixed config for the CPU interpreter (small tiles keep it fast; 16 is tl.dot's minimum).
_CPU_META = {"BLOCK_T": 16, "BLOCK_V": 32, "BLOCK_D": 32}


def _grad_grid(meta: dict) -> tuple[int]:
    return (triton.cdiv(meta["T"], meta["BLOCK_T"]) * triton.cdiv(meta["V"], meta["BLOCK_V"]),)


def _dot_options(hidden_TD: Tensor) -> dict:
    upcast = _INTERPRET or hidden_TD.device.type != "cuda"
    # fp32 inputs must not silently run in TF32: the fp32 path is held to 1e-4.
    precision = "ieee" if hidden_TD.dtype == torch.float32 else "tf32"
    return {"UPCAST": upcast, "PRECISION": precision}


def _num_vocab_splits(num_tokens: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(splits, vocab columns per split): enough programs to fill the GPU when T is small."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        row_blocks = triton.cdiv(num_tokens, 128)
        splits = max(1, min(triton.cdiv(2 * sms, row_blocks), triton.cdiv(vocab, 4096)))
    else:
        splits = triton.cdiv(vocab, 128)  # several slices even at test sizes, to test the combine
    # A multiple of 256 so that every BLOCK_V divides it; no slice is empty.
    per_split = triton.cdiv(triton.cdiv(vocab, splits), 256) * 256
    return triton.cdiv(vocab, per_split), per_split


def forward(hidden_TD: Tensor, weight_VD: Tensor, targets_T: Tensor, temperature_T: Tensor) -> tuple[Tensor, ...]:
    """Fused forward: returns fp32 [T] logprob, entropy and logsumexp (of logits / temperature)."""
    num_tokens, hidden_size = hidden_TD.shape
    vocab = weight_VD.shape[0]
    splits, per_split = _num_vocab_splits(num_tokens, vocab, hidden_TD.device)
    parts_VsT = _empty((4, splits, num_tokens), hidden_TD, torch.float32)
    m_VsT, s_VsT, a_VsT, zt_VsT = parts_VsT.unbind(0)
    args = (
        hidden_TD,
        weight_VD,
        targets_T,
        temperature_T,
        m_VsT,
        s_VsT,
        a_VsT,
        zt_VsT,
        num_tokens,
        hidden_size,
        vocab,
        t_bucket(num_tokens),
        hidden_TD.stride(0),
        weight_VD.stride(0),
        per_split,
    )
    opts = _dot_options(hidden_TD)
    if opts["UPCAST"]:
        grid = (triton.cdiv(num_tokens, _CPU_META["BLOCK_T"]), splits)
        _fwd_kernel[grid](*args, **_CPU_META, EVEN_D=hidden_size % _CPU_META["BLOCK_D"] == 0, **opts)
    else:
        _fwd_tuned[lambda meta: (triton.cdiv(num_tokens, meta["BLOCK_T"]), splits)](*args, **opts)
    m_T = m_VsT.max(dim=0).values
    scale_VsT = torch.exp(m_VsT - m_T)
    s_T = (s_VsT * scale_VsT).sum(0)
    lse_T = m_T + torch.log(s_T)
    entropy_T = lse_T - (a_VsT * scale_VsT).sum(0) / s_T
    logprob_T = zt_VsT.sum(0) - lse_T
    return logprob_T, entropy_T, lse_T


def backward(
    grad_logprob_T: Tensor | None,
    grad_entropy_T: Tensor | None,
    hidden_TD: Tensor,
    weight_VD: Tensor,
    targets_T: Tensor,
    temperature_T: Tensor,
    lse_T: Tensor,
    entropy_T: Tensor,
    grad_buffer_elements: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(d hidden [T, D], d weight [V, D]) in the input dtype; recomputes logits chunk by chunk.

    grad_buffer_elements caps the [chunk, V] scratch buffer (default GRAD_BUFFER_ELEMENTS).
    """
    num_tokens, hidden_size = hidden_TD.shape
    vocab = weight_VD.shape[0]
    if grad_logprob_T is None and grad_entropy_T is None:
        return torch.zeros_like(hidden_TD), torch.zeros_like(weight_VD)
    grad_hidden_TD = _empty(tuple(hidden_TD.shape), hidden_TD, hidden_TD.dtype)
    grad_weight_VD = _empty(tuple(weight_VD.shape), weight_VD, weight_VD.dtype)
    budget = GRAD_BUFFER_ELEMENTS if grad_buffer_elements is None else grad_buffer_elements
    chunk = max(1, min(num_tokens, budget // vocab))
    if chunk >= 128:
        chunk -= chunk % 128
    grad_CV = _empty((chunk, vocab), hidden_TD, hidden_TD.dtype)
    opts = _dot_options(hidden_TD)
    dummy = lse_T  # placeholder pointer for an absent upstream gradient (never read)
    # every chunk tunes under the call's token count: a short last chunk keyed on its own size met a new tuner key
    # whenever a step's length moved it to another bucket (4,971 tuning launches in 2 steps at 8dd7cf1, H100)
    bucket = t_bucket(num_tokens)
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        rows = end - start
        grad_cv = grad_CV[:rows]
        args = (
            hidden_TD[start:end],
            weight_VD,
            targets_T[start:end],
            temperature_T[start:end],
            lse_T[start:end],
            entropy_T[start:end],
            dummy if grad_logprob_T is None else grad_logprob_T[start:end],
            dummy if grad_entropy_T is None else grad_entropy_T[start:end],
            grad_cv,
            rows,
            hidden_size,
            vocab,
            bucket,
            hidden_TD.stride(0),
            weight_VD.stride(0),
            grad_cv.stride(0),
        )
        flags = {"HAS_GLP": grad_logprob_T is not None, "HAS_GENT": grad_entropy_T is not None, "GROUP_T": 8}
        if opts["UPCAST"]:
            grid = (triton.cdiv(rows, _CPU_META["BLOCK_T"]) * triton.cdiv(vocab, _CPU_META["BLOCK_V"]),)
            even_d = hidden_size % _CPU_META["BLOCK_D"] == 0
            _grad_logits_kernel[grid](*args, **flags, **_CPU_META, EVEN_D=even_d, **opts)
        else:
            _grad_tuned[_grad_grid](*args, **flags, **opts)
        torch.mm(grad_cv, weight_VD, out=grad_hidden_TD[start:end])
        if start == 0:
            torch.mm(grad_cv.T, hidden_TD[start:end], out=grad_weight_VD)
        else:  # beta=1 accumulation in the weight dtype: one rounding per chunk (see README).
            grad_weight_VD.addmm_(grad_cv.T, hidden_TD[start:end])
    return grad_hidden_TD, grad_weight_VD
