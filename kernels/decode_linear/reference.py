"""Fused decode linear, the spec: one of a decoder layer's projections for a decode step's few rows,
with the elementwise work around it folded in, rounded op for op as the unfused PyTorch layer
(``prime_spmd/inference/runner.py: make_decode_layer``) rounds it:

    h   = x                                       (no norm)
        | norm_w * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype)          (RMSNorm, HF's op order)
    y   = (h @ w.T + bias).to(dtype)              (fp32 accumulation, one rounding)
    out = y                                       (act "none")
        | (silu(y[:, :I]).to(dtype) * y[:, I:]).to(dtype), w = [gate; up] of 2I rows  (act "silu_mul")
    out = (residual + out).to(dtype)              (when residual is given)

Legend (docs/conventions.md): M rows (a decode step's B), K input features, N output features of ``w``
(2I for "silu_mul", whose output has I = N / 2 columns).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTS = ("none", "silu_mul")


def decode_linear_reference(
    x_MK: torch.Tensor,
    w_NK: torch.Tensor,
    bias_N: torch.Tensor | None = None,
    norm_w_K: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual_MNo: torch.Tensor | None = None,
    act: str = "none",
) -> torch.Tensor:
    """out [M, No] in x's dtype (No = N, or N / 2 for "silu_mul"); see the module docstring."""
    x_MK = norm_input(x_MK, norm_w_K, eps)
    y = torch.mm(x_MK.float(), w_NK.float().T)
    if bias_N is not None:
        y = y + bias_N.float()
    return finish_output(y.to(x_MK.dtype), act, residual_MNo)


def norm_input(x_MK: torch.Tensor, norm_w_K: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The folded-in RMSNorm (HF's op order; x as is without ``norm_w_K``)."""
    if norm_w_K is None:
        return x_MK
    xf = x_MK.float()
    return norm_w_K * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x_MK.dtype)


def finish_output(
    y_MN: torch.Tensor, act: str, residual_MNo: torch.Tensor | None, name: str = "decode_linear"
) -> torch.Tensor:
    """The linear's rounded output -> the activation and the residual add (``name``: the op, for the error)."""
    if act == "silu_mul":
        inter = y_MN.shape[1] // 2
        y_MN = F.silu(y_MN[:, :inter]) * y_MN[:, inter:]
    elif act != "none":
        raise ValueError(f"{name}: act {act!r}; choose one of {ACTS}")
    return y_MN if residual_MNo is None else residual_MNo + y_MN
