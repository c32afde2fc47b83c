"""Entry points: ``quantize_fp8_`` (in place), ``fp8_fused_linear`` (decode steps within the runner's fused row bounds:
the GEMV, or for more rows the tile kernel or ``_scaled_mm`` by ``TILE_ROWS_IMPL``), ``fp8_decode_linear`` (the
Triton kernels) and ``fp8_linear`` (prefill and decode steps past the fused kernels' row bounds).

``prime_spmd::fp8_decode_linear`` is a ``torch.library`` op with a fake impl, so it sits inside
``torch.compile(fullgraph=True)`` and CUDA-graph capture, as ``prime_spmd::decode_linear`` does. Inference only: no
backward is registered. The quantize runs outside graphs (at load and at each weight sync), as a plain call.

Legend: see reference.py (M rows, K in, N out features of w, No output columns).
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.nn.functional as F
from prime_spmd.kernels.decode_linear.reference import finish_output, norm_input
from prime_spmd.kernels.fp8.reference import (
    FP8_DTYPE,
    fp8_decode_linear_reference,
    fp8_linear_reference,
    quantize_fp8_reference,
    quantize_rows_fp8_reference,
)

Fp8Impl = Literal["reference", "triton"]
Fp8LinearImpl = Literal["reference", "dequant", "scaled_mm"]
TILE_ROWS_IMPLS = ("triton", "scaled_mm")
TILE_ROWS_IMPL: str = os.environ.get("PRIME_SPMD_FP8_TILE_ROWS", "scaled_mm")
"""What ``fp8_fused_linear`` runs for bf16 steps the GEMV does not take (more than ``GEMV_MAX_ROWS`` rows, or K past
``GEMV_MAX_K``): "triton" (the FP8 tile kernel: bf16 activations times e4m3 weights, norm / SiLU-gate / residual
fused) or "scaled_mm" (``fp8_linear``'s ``torch._scaled_mm``: activations quantized per row to e4m3, FP8 tensor
cores; the norm, the quantize, SiLU-gate and residual are torch ops that torch.compile fuses around the GEMM). A
benchmark setting, not a user flag: ``benchmarks/engine.py --fp8-tile-rows`` sets it (or the environment variable
PRIME_SPMD_FP8_TILE_ROWS); it is read when the decode layer is traced (a compiled graph guards on it). Default
"scaled_mm": H100, commit 0c4ade1, batch 64, 256 new tokens: 9,593 tokens/s against the tile kernel's 7,580 at the
Qwen3-8B shape (bf16: 8,001); 27,388 against 28,487 at the 0.6B shape (docs/benchmarks.md)."""
GEMV_MAX_ROWS = 1
GEMV_MAX_K = 16384
"""The FP8 GEMV (kernel.py) takes one row of K up to this: Qwen3-8B's down projection (K 12,288) included, which
otherwise ran the tile kernel with 15 padding rows of 16. K past ``kernel.PRELOAD_MAX_K`` runs its chunked form."""


def quantize_fp8_(w_NK: torch.Tensor, q_NK: torch.Tensor, scale_N: torch.Tensor, impl: Fp8Impl = "reference") -> None:
    """Write ``q_NK`` (float8_e4m3fn, [N, K]) and ``scale_N`` (fp32, [N]) of ``w_NK`` in place (row slices of larger
    tensors allowed: last dims contiguous). ValueError on shapes or dtypes it cannot take."""
    if w_NK.ndim != 2 or q_NK.shape != w_NK.shape or tuple(scale_N.shape) != (w_NK.shape[0],):
        raise ValueError(
            f"quantize_fp8_: want w, q [N, K] and scale [N]; got {w_NK.shape}, {q_NK.shape}, {scale_N.shape}"
        )
    if q_NK.dtype != FP8_DTYPE or scale_N.dtype != torch.float32:
        raise ValueError(f"quantize_fp8_: q must be {FP8_DTYPE} and scale float32, got {q_NK.dtype}, {scale_N.dtype}")
    if w_NK.stride(-1) != 1 or q_NK.stride(-1) != 1 or scale_N.stride(0) != 1:
        raise ValueError("quantize_fp8_: w, q and scale need contiguous last dims")
    if impl == "triton":
        from prime_spmd.kernels.fp8 import kernel

        kernel.quantize_fp8(w_NK, q_NK, scale_N)
        return
    if impl != "reference":
        raise ValueError(f"unknown fp8 quantize impl {impl!r}; choose reference or triton")
    q, s = quantize_fp8_reference(w_NK)
    q_NK.copy_(q)
    scale_N.copy_(s)


def check_inputs(x_MK, q_NK, scale_N, bias_N, norm_w_K, residual_MNo, act: str) -> None:
    """ValueError naming the bad shape, dtype or act (host metadata only)."""
    if act not in ("none", "silu_mul"):
        raise ValueError(f"fp8_decode_linear: act {act!r}; choose none or silu_mul")
    if x_MK.ndim != 2 or q_NK.ndim != 2 or x_MK.shape[1] != q_NK.shape[1]:
        raise ValueError(f"fp8_decode_linear: want x [M, K] and q [N, K]; got {tuple(x_MK.shape)}, {tuple(q_NK.shape)}")
    n, k = q_NK.shape
    if q_NK.dtype != FP8_DTYPE or scale_N.dtype != torch.float32 or tuple(scale_N.shape) != (n,):
        raise ValueError(f"fp8_decode_linear: q must be {FP8_DTYPE} [N, K] and scale float32 [N]")
    if act == "silu_mul" and n % 2:
        raise ValueError(f"fp8_decode_linear: silu_mul needs q of 2I rows ([gate; up]), got {n}")
    no = n // 2 if act == "silu_mul" else n
    for name, t, shape in (
        ("bias", bias_N, (n,)),
        ("norm_w", norm_w_K, (k,)),
        ("residual", residual_MNo, (x_MK.shape[0], no)),
    ):
        if t is not None and (tuple(t.shape) != shape or t.dtype != x_MK.dtype):
            raise ValueError(
                f"fp8_decode_linear: {name} must be {list(shape)} of {x_MK.dtype}, got {list(t.shape)} {t.dtype}"
            )
    for name, t in (("x", x_MK), ("q", q_NK), ("residual", residual_MNo)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"fp8_decode_linear: {name}'s last dim must be contiguous (strides {t.stride()})")


def fp8_decode_linear(
    x_MK: torch.Tensor,
    q_NK: torch.Tensor,
    scale_N: torch.Tensor,
    bias_N: torch.Tensor | None = None,
    norm_w_K: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual_MNo: torch.Tensor | None = None,
    act: str = "none",
    impl: Fp8Impl = "reference",
) -> torch.Tensor:
    """[M, No] in x's dtype: kernels/decode_linear's fused linear with FP8 weights ``q * scale`` (reference.py)."""
    check_inputs(x_MK, q_NK, scale_N, bias_N, norm_w_K, residual_MNo, act)
    if impl == "reference":
        return fp8_decode_linear_reference(x_MK, q_NK, scale_N, bias_N, norm_w_K, eps, residual_MNo, act)
    if impl == "triton":
        return torch.ops.prime_spmd.fp8_decode_linear(
            x_MK, q_NK, scale_N, bias_N, norm_w_K, eps, residual_MNo, act == "silu_mul"
        )
    raise ValueError(f"unknown fp8 decode linear impl {impl!r}; choose reference or triton")


@torch.library.custom_op("prime_spmd::fp8_decode_linear", mutates_args=())
def fp8_decode_linear_op(
    x_MK: torch.Tensor,
    q_NK: torch.Tensor,
    scale_N: torch.Tensor,
    bias_N: torch.Tensor | None,
    norm_w_K: torch.Tensor | None,
    eps: float,
    residual_MNo: torch.Tensor | None,
    silu_mul: bool,
) -> torch.Tensor:
    """The Triton kernel (kernel.fp8_decode_linear); inputs as ``fp8_decode_linear`` above."""
    from prime_spmd.kernels.fp8 import kernel

    return kernel.fp8_decode_linear(x_MK, q_NK, scale_N, bias_N, norm_w_K, eps, residual_MNo, silu_mul)


@fp8_decode_linear_op.register_fake
def _(x_MK, q_NK, scale_N, bias_N, norm_w_K, eps, residual_MNo, silu_mul):
    no = q_NK.shape[0] // 2 if silu_mul else q_NK.shape[0]
    return x_MK.new_empty(x_MK.shape[0], no)


def uses_gemv(m: int, k: int) -> bool:
    """Whether a decode step of M rows and K inputs runs the FP8 GEMV kernel (else the tile kernel or _scaled_mm)."""
    return m <= GEMV_MAX_ROWS and k <= GEMV_MAX_K


def tile_rows_impl(m: int, k: int, dtype: torch.dtype, tile_rows: str | None = None) -> str:
    """``fp8_fused_linear``'s path for M rows of K inputs in ``dtype``: "gemv", "triton" (the tile kernel) or
    "scaled_mm" (``tile_rows``, None: ``TILE_ROWS_IMPL``, for bf16; row-wise ``_scaled_mm`` writes bf16 only).
    ValueError naming PRIME_SPMD_FP8_TILE_ROWS for an unknown setting."""
    impl = TILE_ROWS_IMPL if tile_rows is None else tile_rows
    if impl not in TILE_ROWS_IMPLS:
        raise ValueError(f"PRIME_SPMD_FP8_TILE_ROWS / fp8 TILE_ROWS_IMPL {impl!r}: choose triton or scaled_mm")
    if uses_gemv(m, k):
        return "gemv"
    return impl if dtype == torch.bfloat16 else "triton"


def fp8_fused_linear(
    x_MK: torch.Tensor,
    q_NK: torch.Tensor,
    scale_N: torch.Tensor,
    bias_N: torch.Tensor | None,
    norm_w_K: torch.Tensor | None,
    eps: float,
    residual_MNo: torch.Tensor | None,
    silu_mul: bool,
    tile_rows: str | None = None,
) -> torch.Tensor:
    """A decode step's fused linear over FP8 weights (arguments as the op ``prime_spmd::fp8_decode_linear``): the
    Triton op, or where ``tile_rows_impl`` says "scaled_mm" (``tile_rows`` None: ``TILE_ROWS_IMPL``), RMSNorm,
    ``fp8_linear(impl="scaled_mm")``, SiLU-gate and residual as torch ops (rounded as decode_linear/reference.py; the
    GEMM also rounds x to e4m3 per row: ``fp8_scaled_mm_reference``). Traceable: the choice is made on shapes and
    module state at trace time."""
    if tile_rows_impl(x_MK.shape[0], x_MK.shape[1], x_MK.dtype, tile_rows) != "scaled_mm":
        return torch.ops.prime_spmd.fp8_decode_linear(
            x_MK, q_NK, scale_N, bias_N, norm_w_K, eps, residual_MNo, silu_mul
        )
    y = fp8_linear(norm_input(x_MK, norm_w_K, eps), q_NK, scale_N, bias_N, impl="scaled_mm")
    return finish_output(y, "silu_mul" if silu_mul else "none", residual_MNo, name="fp8_fused_linear")


def fp8_linear(
    x: torch.Tensor,
    q_NK: torch.Tensor,
    scale_N: torch.Tensor,
    bias_N: torch.Tensor | None = None,
    impl: Fp8LinearImpl = "reference",
) -> torch.Tensor:
    """``x @ (q * scale).T + bias`` over any leading dims of x, in x's dtype. impls: "reference" (fp32 upcast matmul,
    any device), "dequant" (dequantize to x's dtype, then its GEMM: weight bytes read twice, no activation rounding),
    "scaled_mm" (``torch._scaled_mm`` with row-wise scales: x quantized per row to e4m3 on the fly, FP8 tensor
    cores, K and N multiples of 16; CUDA of compute capability >= 8.9)."""
    if impl == "reference":
        return fp8_linear_reference(x, q_NK, scale_N, bias_N)
    if impl == "dequant":
        return F.linear(x, (q_NK.float() * scale_N[:, None]).to(x.dtype), bias_N)
    if impl != "scaled_mm":
        raise ValueError(f"unknown fp8 linear impl {impl!r}; choose reference, dequant or scaled_mm")
    lead, k = x.shape[:-1], x.shape[-1]
    xq, sx = quantize_rows_fp8_reference(x.reshape(-1, k))  # torch ops: torch.compile fuses them with x's producer
    y = torch._scaled_mm(xq, q_NK.T, sx, scale_N[None, :], bias=bias_N, out_dtype=x.dtype)
    return y.reshape(*lead, q_NK.shape[0])
