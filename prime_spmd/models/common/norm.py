"""RMSNorm, written to match Hugging Face's Qwen3RMSNorm bit for bit (normalize in fp32, scale in input dtype)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama/Qwen RMSNorm, op for op: fp32 statistics, cast back to x's dtype, then scale by ``w`` (the trainer's
    modules and the inference engine's layer functions share it)."""
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))`` over the last dim; x any float dtype, statistics in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
