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
    if norm_w_K is not None:
        xf = x_MK.float()
        x_MK = norm_w_K * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x_MK.dtype)
    y = torch.mm(x_MK.float(), w_NK.float().T)
    if bias_N is not None:
        y = y + bias_N.float()
    y = y.to(x_MK.dtype)
    if act == "silu_mul":
        inter = y.shape[1] // 2
        y = F.silu(y[:, :inter]) * y[:, inter:]
    elif act != "none":
        raise ValueError(f"decode_linear: act {act!r}; choose one of {ACTS}")
    if residual_MNo is not None:
        y = residual_MNo + y
    return y
