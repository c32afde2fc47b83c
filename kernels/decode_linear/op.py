"""The entry point the native engine uses: ``decode_linear(..., impl=...)``.

``reference``: pure PyTorch (reference.py), any device. ``triton``: the kernel (kernel.py) as the
``torch.library`` op ``prime_spmd::decode_linear``, with a fake impl so it sits inside
``torch.compile(fullgraph=True)`` and CUDA-graph capture. Inference only: no backward is registered.

Legend: see reference.py (M rows, K in, N out features of w, No output columns).
"""

from __future__ import annotations

from typing import Literal

import torch
from prime_spmd.kernels.decode_linear.reference import ACTS, decode_linear_reference

DecodeLinearImpl = Literal["reference", "triton"]


def check_inputs(x_MK, w_NK, bias_N, norm_w_K, residual_MNo, act: str) -> None:
    """ValueError naming the bad shape, dtype or act (host-side metadata only: no device sync)."""
    if act not in ACTS:
        raise ValueError(f"decode_linear: act {act!r}; choose one of {ACTS}")
    if x_MK.ndim != 2 or w_NK.ndim != 2 or x_MK.shape[1] != w_NK.shape[1]:
        raise ValueError(f"decode_linear: want x [M, K] and w [N, K]; got x {tuple(x_MK.shape)}, w {tuple(w_NK.shape)}")
    n, k = w_NK.shape
    if act == "silu_mul" and n % 2:
        raise ValueError(f"decode_linear: silu_mul needs w of 2I rows ([gate; up]), got {n}")
    no = n // 2 if act == "silu_mul" else n
    for name, t, shape in (
        ("bias", bias_N, (n,)),
        ("norm_w", norm_w_K, (k,)),
        ("residual", residual_MNo, (x_MK.shape[0], no)),
    ):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"decode_linear: {name} must be {list(shape)}, got {list(t.shape)}")
    for name, t in (("x", x_MK), ("w", w_NK), ("bias", bias_N), ("norm_w", norm_w_K), ("residual", residual_MNo)):
        if t is None:
            continue
        if t.dtype != x_MK.dtype:
            raise ValueError(f"decode_linear: {name} is {t.dtype}, x is {x_MK.dtype} (one dtype for all)")
        if t.stride(-1) != 1:
            raise ValueError(f"decode_linear: {name}'s last dim must be contiguous (strides {t.stride()})")


def decode_linear(
    x_MK: torch.Tensor,
    w_NK: torch.Tensor,
    bias_N: torch.Tensor | None = None,
    norm_w_K: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual_MNo: torch.Tensor | None = None,
    act: str = "none",
    impl: DecodeLinearImpl = "reference",
) -> torch.Tensor:
    """[M, No] in x's dtype: optional RMSNorm of x, x @ w.T (+ bias), optional SiLU-gate, optional residual
    (reference.py states the rounding). No side effects."""
    check_inputs(x_MK, w_NK, bias_N, norm_w_K, residual_MNo, act)
    if impl == "reference":
        return decode_linear_reference(x_MK, w_NK, bias_N, norm_w_K, eps, residual_MNo, act)
    if impl == "triton":
        return torch.ops.prime_spmd.decode_linear(x_MK, w_NK, bias_N, norm_w_K, eps, residual_MNo, act == "silu_mul")
    raise ValueError(f"unknown decode linear impl {impl!r}; choose reference or triton")


@torch.library.custom_op("prime_spmd::decode_linear", mutates_args=())
def decode_linear_op(
    x_MK: torch.Tensor,
    w_NK: torch.Tensor,
    bias_N: torch.Tensor | None,
    norm_w_K: torch.Tensor | None,
    eps: float,
    residual_MNo: torch.Tensor | None,
    silu_mul: bool,
) -> torch.Tensor:
    """The Triton kernel (kernel.decode_linear); inputs as ``decode_linear`` above."""
    from prime_spmd.kernels.decode_linear import kernel

    return kernel.decode_linear(x_MK, w_NK, bias_N, norm_w_K, eps, residual_MNo, silu_mul)


@decode_linear_op.register_fake
def _(x_MK, w_NK, bias_N, norm_w_K, eps, residual_MNo, silu_mul):
    no = w_NK.shape[0] // 2 if silu_mul else w_NK.shape[0]
    return x_MK.new_empty(x_MK.shape[0], no)
