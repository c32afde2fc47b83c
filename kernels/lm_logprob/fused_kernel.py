"""Triton kernels for the loss-fused LM head (`fused_loss.py`, impl="triton"): the elementwise work on one
chunk's logits, between the cuBLAS GEMMs.

- `softmax_stats`: one read of the [C, V] logits; per token the logsumexp and the expected logit
  E_p[z] (so entropy = lse - E_p[z]) of z = logits / temperature, with an online max over vocabulary slices.
- `write_grad_logits`: one more read of the logits and one write of G = d loss / d logits in the GEMM
  dtype: G = (g_lp (onehot - p) + g_ent p (E_p[z] - z)) / temperature.
Between the two, the caller evaluates the per-token loss on [C] tensors to get g_lp and g_ent: it is user
Python, so the two passes cannot be one kernel.

CPU: TRITON_INTERPRET=1 runs one fixed small config (autotune with several configs fails under the
interpreter); the kernels do no tl.dot, so bf16 needs no upcast workaround here.

Shape legend (docs/conventions.md): C tokens in a chunk, V vocabulary size; local letter of this file: Vs
vocabulary slices (the stats kernel's split of V over programs). Kernel scalars C, V and tiles BLOCK_C,
BLOCK_V use the same letters.
"""

import os

import torch
import triton
import triton.language as tl
from prime_spmd.kernels.lm_logprob.kernel import t_bucket
from torch import Tensor

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def empty_buffer(shape: tuple[int, ...], like: Tensor, dtype: torch.dtype) -> Tensor:
    """Every output and scratch buffer of the fused loss comes from here, so tests can NaN-poison them."""
    return torch.empty(shape, device=like.device, dtype=dtype)


@triton.jit
def _stats_kernel(
    x_ptr,
    temp_ptr,
    m_ptr,
    s_ptr,
    a_ptr,
    C,
    V,
    C_BUCKET,
    stride_xc,
    v_per_split,
    BLOCK_C: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Per (row block, vocab slice): running max m, s = sum exp(z - m), a = sum exp(z - m) z."""
    pid_c = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    inv_temp = 1.0 / tl.load(temp_ptr + offs_c, mask=mask_c, other=1.0)
    rows = x_ptr + offs_c.to(tl.int64)[:, None] * stride_xc
    m = tl.full((BLOCK_C,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_C,), dtype=tl.float32)
    a = tl.zeros((BLOCK_C,), dtype=tl.float32)
    v_start = pid_s * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < v_end
        x = tl.load(rows + offs_v[None, :], mask=mask_c[:, None] & mask_v[None, :], other=0.0)
        z = x.to(tl.float32) * inv_temp[:, None]
        z_masked = tl.where(mask_v[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_masked, axis=1))  # finite: every tile has >= 1 valid column
        alpha = tl.exp(m - m_new)
        p = tl.exp(z_masked - m_new[:, None])
        s = s * alpha + tl.sum(p, axis=1)
        a = a * alpha + tl.sum(p * tl.where(mask_v[None, :], z, 0.0), axis=1)
        m = m_new
    out = pid_s * C + offs_c
    tl.store(m_ptr + out, m, mask=mask_c)
    tl.store(s_ptr + out, s, mask=mask_c)
    tl.store(a_ptr + out, a, mask=mask_c)


@triton.jit
def _grad_kernel(
    x_ptr,
    g_ptr,
    tgt_ptr,
    temp_ptr,
    lse_ptr,
    ez_ptr,
    glp_ptr,
    gent_ptr,
    C,
    V,
    C_BUCKET,
    stride_xc,
    stride_gc,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """G tile = (g_lp (onehot - p) + g_ent p (E_p[z] - z)) / temperature, stored in g_ptr's dtype."""
    pid_v = tl.program_id(0)  # vocab blocks on axis 0: up to 2**31 programs there, 65535 on axis 1
    pid_c = tl.program_id(1)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_c = offs_c < C
    mask = mask_c[:, None] & (offs_v < V)[None, :]
    rows = offs_c.to(tl.int64)[:, None]
    inv_temp = 1.0 / tl.load(temp_ptr + offs_c, mask=mask_c, other=1.0)
    lse = tl.load(lse_ptr + offs_c, mask=mask_c, other=0.0)
    x = tl.load(x_ptr + rows * stride_xc + offs_v[None, :], mask=mask, other=0.0)
    z = x.to(tl.float32) * inv_temp[:, None]
    p = tl.exp(z - lse[:, None])
    g = tl.zeros((BLOCK_C, BLOCK_V), dtype=tl.float32)
    if HAS_GLP:
        glp = tl.load(glp_ptr + offs_c, mask=mask_c, other=0.0)
        tgt = tl.load(tgt_ptr + offs_c, mask=mask_c, other=-1)
        onehot = (offs_v[None, :] == tgt[:, None]).to(tl.float32)
        g += glp[:, None] * (onehot - p)
    if HAS_GENT:
        gent = tl.load(gent_ptr + offs_c, mask=mask_c, other=0.0)
        ez = tl.load(ez_ptr + offs_c, mask=mask_c, other=0.0)
        g += gent[:, None] * p * (ez[:, None] - z)
    g = g * inv_temp[:, None]  # d z / d logits = 1 / temperature
    tl.store(g_ptr + rows * stride_gc + offs_v[None, :], g.to(g_ptr.dtype.element_ty), mask=mask)


def _configs(shapes: list[tuple[int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_C": bc, "BLOCK_V": bv}, num_warps=w) for bc, bv, w in shapes]


# Memory-bound tiles of 4k-16k elements (H200: 132 SMs). The tuner keys on C rounded up to a power of two
# (C_BUCKET, unused in the kernels), not on C: RL micro-batches vary C every step, and each new key would
# re-run the tuner (~0.5 s per kernel).
_KEY = ["C_BUCKET", "V"]
_stats_tuned = triton.autotune(_configs([(4, 1024, 4), (8, 1024, 8), (16, 512, 8), (2, 2048, 8)]), _KEY)(_stats_kernel)
_grad_tuned = triton.autotune(_configs([(16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 8)]), _KEY)(_grad_kernel)
# One fixed config for the CPU interpreter: small tiles, so the test shapes have ragged tails.
_CPU_META = {"BLOCK_C": 4, "BLOCK_V": 64}


def _num_vocab_splits(num_tokens: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(splits, vocab columns per split): enough programs to fill the GPU when the chunk is small."""
    if device.type == "cuda" and not INTERPRET:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        # >= 8 programs per SM even with the tallest tile (BLOCK_C = 16), for load balance.
        splits = max(1, min(triton.cdiv(8 * sms, triton.cdiv(num_tokens, 16)), triton.cdiv(vocab, 8192)))
        align = 2048  # the largest BLOCK_V, so that no tile straddles two slices
    else:
        splits = triton.cdiv(vocab, 128)  # several slices even at test sizes, to test the combine
        align = _CPU_META["BLOCK_V"]
    per_split = triton.cdiv(triton.cdiv(vocab, splits), align) * align
    return triton.cdiv(vocab, per_split), per_split


def softmax_stats(logits_CV: Tensor, temperature_C: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 [C] logsumexp and E_p[z] of z = logits / temperature; logits_CV row-major (any float dtype)."""
    num_tokens, vocab = logits_CV.shape
    assert logits_CV.stride(1) == 1
    splits, per_split = _num_vocab_splits(num_tokens, vocab, logits_CV.device)
    parts_VsC = empty_buffer((3, splits, num_tokens), logits_CV, torch.float32)
    m_VsC, s_VsC, a_VsC = parts_VsC.unbind(0)
    bucket = t_bucket(num_tokens)
    args = (logits_CV, temperature_C, m_VsC, s_VsC, a_VsC, num_tokens, vocab, bucket, logits_CV.stride(0), per_split)
    if INTERPRET or logits_CV.device.type != "cuda":
        _stats_kernel[(triton.cdiv(num_tokens, _CPU_META["BLOCK_C"]), splits)](*args, **_CPU_META)
    else:
        _stats_tuned[lambda meta: (triton.cdiv(num_tokens, meta["BLOCK_C"]), splits)](*args)
    m_C = m_VsC.max(dim=0).values
    scale_VsC = torch.exp(m_VsC - m_C)
    s_C = (s_VsC * scale_VsC).sum(0)
    lse_C = m_C + torch.log(s_C)
    expected_z_C = (a_VsC * scale_VsC).sum(0) / s_C
    return lse_C, expected_z_C


def write_grad_logits(
    logits_CV: Tensor,
    grad_CV: Tensor,
    targets_C: Tensor,
    temperature_C: Tensor,
    lse_C: Tensor,
    expected_z_C: Tensor,
    grad_logprob_C: Tensor | None,
    grad_entropy_C: Tensor | None,
) -> None:
    """Fill grad_CV (row-major, the GEMM dtype) with d loss / d logits; at least one grad is not None."""
    num_tokens, vocab = logits_CV.shape
    assert grad_CV.shape == logits_CV.shape and grad_CV.stride(1) == 1 and logits_CV.stride(1) == 1
    assert grad_logprob_C is not None or grad_entropy_C is not None
    dummy = lse_C  # placeholder pointer for an absent per-token gradient (never read)
    args = (
        logits_CV,
        grad_CV,
        targets_C,
        temperature_C,
        lse_C,
        expected_z_C,
        dummy if grad_logprob_C is None else grad_logprob_C,
        dummy if grad_entropy_C is None else grad_entropy_C,
        num_tokens,
        vocab,
        t_bucket(num_tokens),
        logits_CV.stride(0),
        grad_CV.stride(0),
    )
    flags = {"HAS_GLP": grad_logprob_C is not None, "HAS_GENT": grad_entropy_C is not None}
    if INTERPRET or logits_CV.device.type != "cuda":
        grid = (triton.cdiv(vocab, _CPU_META["BLOCK_V"]), triton.cdiv(num_tokens, _CPU_META["BLOCK_C"]))
        _grad_kernel[grid](*args, **flags, **_CPU_META)
    else:
        _grad_tuned[lambda meta: (triton.cdiv(vocab, meta["BLOCK_V"]), triton.cdiv(num_tokens, meta["BLOCK_C"]))](
            *args, **flags
        )
