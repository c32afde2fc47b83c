"""FP8 weights, the spec: float8 e4m3 weights with one fp32 scale per output channel (row of ``w``).

    scale_N = max(amax(|w_N:|), AMAX_FLOOR) / FP8_MAX                     (fp32)
    q_NK    = round_to_nearest_even(w_NK.float() / scale_N).to(float8_e4m3fn)   (clamped to +-448 against rounding)
    w_NK   ~= q_NK.float() * scale_N                                      (dequantize)

A linear then accumulates ``x @ q.T`` in fp32 and scales each output column once (the scale is constant along K):

    y = ((x_f32 @ q_f32.T) * scale_N + bias).to(dtype)

``fp8_decode_linear_reference`` is ``kernels/decode_linear``'s spec (RMSNorm prologue, SiLU-gate, residual: the
same roundings) with that product in place of ``h @ w.T``.

Why per output channel (not 128 x 128 blocks): a decode GEMV / tile program owns whole output rows, so one scale per
row is one fp32 load per program and one multiply in the epilogue, no per-K-block rescale in the inner loop; the
engine's fused QKV and gate/up tensors quantize each part's rows alone, so a weight sync of q_proj writes only its
rows' scales; and ``torch._scaled_mm``'s row-wise mode takes exactly this layout for prefill. The price is range:
one outlier in a row sets the step for all its K inputs (measured: mismatch KL in docs/benchmarks.md).

Legend (docs/conventions.md, GEMM roles): M rows, K in, N out features of w.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from prime_spmd.kernels.decode_linear.reference import finish_output, norm_input

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-12
"""A row of zeros gets this amax (scale ~2e-15, q all zeros) instead of a division by zero."""


def quantize_fp8_reference(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_NK float8_e4m3fn, scale_N fp32) of ``w_NK`` (any float dtype); see the module docstring."""
    wf = w_NK.float()
    amax_N = wf.abs().amax(dim=1).clamp(min=AMAX_FLOOR)
    # a tensor divisor: torch divides a CUDA tensor by a Python scalar as a multiply by its reciprocal (not correctly
    # rounded: scales 1 ulp off the kernel's div_rn on the H100); tensor / tensor is IEEE division on CPU and CUDA
    scale_N = amax_N / torch.full_like(amax_N, FP8_MAX)
    q_NK = (wf / scale_N[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q_NK, scale_N


def quantize_rows_fp8_reference(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row activation quantize, as ``torch._scaled_mm`` takes it: (xq [M, K] float8_e4m3fn, scale [M, 1]
    fp32) with ``x ~= xq * scale``; the scale is the row's amax / FP8_MAX (floored as the weights' are)."""
    xf = x_MK.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


def fp8_scaled_mm_reference(
    x_MK: torch.Tensor, q_NK: torch.Tensor, scale_N: torch.Tensor, bias_N: torch.Tensor | None = None
) -> torch.Tensor:
    """What ``torch._scaled_mm`` with row-wise scales computes (``op.fp8_linear(impl="scaled_mm")``): x quantized per
    row (``quantize_rows_fp8_reference``), the e4m3 products summed in fp32, each row times its scale and each
    column times its own, plus bias, rounded once to x's dtype. x [M, K]."""
    xq, sx = quantize_rows_fp8_reference(x_MK)
    y = F.linear(xq.float(), q_NK.float()) * sx * scale_N.float()
    if bias_N is not None:
        y = y + bias_N.float()
    return y.to(x_MK.dtype)


def dequantize_fp8_reference(q_NK: torch.Tensor, scale_N: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q_NK * scale_N`` in ``dtype`` (one rounding from fp32)."""
    return (q_NK.float() * scale_N.float()[:, None]).to(dtype)


def fp8_linear_reference(
    x_MK: torch.Tensor, q_NK: torch.Tensor, scale_N: torch.Tensor, bias_N: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ (q * scale).T + bias`` in x's dtype over any leading dims of x: fp32 upcast matmul, scale per column."""
    y = F.linear(x_MK.float(), q_NK.float()) * scale_N.float()
    if bias_N is not None:
        y = y + bias_N.float()
    return y.to(x_MK.dtype)


def fp8_decode_linear_reference(
    x_MK: torch.Tensor,
    q_NK: torch.Tensor,
    scale_N: torch.Tensor,
    bias_N: torch.Tensor | None = None,
    norm_w_K: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual_MNo: torch.Tensor | None = None,
    act: str = "none",
) -> torch.Tensor:
    """kernels/decode_linear's ``decode_linear_reference`` with ``w = q * scale``: out [M, No] in x's dtype."""
    y = fp8_linear_reference(norm_input(x_MK, norm_w_K, eps), q_NK, scale_N, bias_N)
    return finish_output(y, act, residual_MNo, name="fp8_decode_linear")
