"""Rotary position embedding (the "default" rope type of HF configs: half-split rotation).

Legend (docs/conventions.md): B batch, T tokens, N heads (query heads, or Nkv for k), Dh head dim.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables [B, T, Dh] for arbitrary ``position_ids`` (packed sequences restart at 0)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        if torch.get_default_device().type == "meta":  # built on meta: a placeholder that reset_parameters fills
            # (torch.arange on meta runs through torch._refs, whose first call imports torch._dynamo: models/common/meta.py)
            return torch.empty(self.head_dim // 2, dtype=torch.float)
        return 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))

    def reset_parameters(self) -> None:
        """Recompute the buffer (needed after building on the meta device)."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def forward(self, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 angles, as HF computes them, so logits match to the last bit in fp32
        freqs = position_ids_BT[..., None].float() * self.inv_freq.float()  # [B, T, Dh / 2]
        emb_BTDh = torch.cat((freqs, freqs), dim=-1)
        return emb_BTDh.cos().to(dtype), emb_BTDh.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``: RoPE with tables already broadcastable to ``x`` (the trainer's modules and
    the inference engine's layer functions share it)."""
    return x * cos + rotate_half(x) * sin


def apply_rope(x_BTNDh: torch.Tensor, cos_BTDh: torch.Tensor, sin_BTDh: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, T, N, Dh] by the tables [B, T, Dh]."""
    return rotate(x_BTNDh, cos_BTDh.unsqueeze(2), sin_BTDh.unsqueeze(2))
