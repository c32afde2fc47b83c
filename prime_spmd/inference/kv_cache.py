"""The native engine's KV cache: fixed slots, allocated once, reused for every request.

Shapes: ``S`` slots (max batch size), ``L`` max model length, ``Hkv`` kv heads, ``D`` head dim.
Layout per layer is [S, Hkv, L, D] so that a decode step's read of slots [0, n) and positions
[0, Lb) is a strided view whose (slot, head) batch dims collapse into one stride: batched matmuls
read it in place, with no gather or copy.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    """Preallocated K and V for ``num_layers`` layers, each [S, Hkv, L, D] in ``dtype``."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.max_len, self.num_kv_heads = num_slots, max_len, num_kv_heads

    def nbytes_per_token(self) -> int:
        """Bytes of K+V one token occupies across all layers."""
        nl, _, hkv, _, d = self.k.shape
        return 2 * nl * hkv * d * self.k.element_size()

    def write_prefill(self, layer: int, slots_N: torch.Tensor, k_NHTD: torch.Tensor, v_NHTD: torch.Tensor) -> None:
        """Store a prefill's K/V [N, Hkv, T, D] at positions [0, T) of ``slots_N``."""
        t = k_NHTD.shape[2]
        self.k[layer, slots_N, :, :t] = k_NHTD
        self.v[layer, slots_N, :, :t] = v_NHTD

    def write_decode(self, layer: int, pos_B: torch.Tensor, k_BHD: torch.Tensor, v_BHD: torch.Tensor) -> None:
        """Store one token per slot 0..B-1 at position ``pos_B[b]`` (graph-capturable index_put_)."""
        b, h, d = k_BHD.shape
        rows = torch.arange(b * h, device=pos_B.device)
        pos = pos_B[:, None].expand(b, h).reshape(-1)  # no host sync, unlike repeat_interleave
        kl = self.k[layer, :b].reshape(b * h, self.max_len, d)
        vl = self.v[layer, :b].reshape(b * h, self.max_len, d)
        kl.index_put_((rows, pos), k_BHD.reshape(b * h, d))
        vl.index_put_((rows, pos), v_BHD.reshape(b * h, d))

    def copy_prefix(self, src_N: torch.Tensor, dst_N: torch.Tensor, num_tokens: int) -> None:
        """Copy positions [0, num_tokens) of slots ``src_N`` into slots ``dst_N``, all layers (prefix
        sharing: a GRPO group's prompt is prefilled once). Costs a copy, not a prefill; the memory
        is still one slot per sequence (block sharing would need a paged cache)."""
        self.k[:, dst_N, :, :num_tokens] = self.k[:, src_N, :, :num_tokens]
        self.v[:, dst_N, :, :num_tokens] = self.v[:, src_N, :, :num_tokens]

    def read(self, layer: int, num_rows: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of K and V [num_rows, Hkv, kv_len, D] (slots 0..num_rows-1)."""
        return self.k[layer, :num_rows, :, :kv_len], self.v[layer, :num_rows, :, :kv_len]


def bucket_sizes(limit: int, first: int, growth: str) -> list[int]:
    """Sizes up to and including ``limit``: powers of two from ``first`` (growth='pow2') or multiples of ``first``."""
    out: list[int] = []
    s = first
    while s < limit:
        out.append(s)
        s = s * 2 if growth == "pow2" else s + first
    out.append(limit)
    return out


def pick_bucket(buckets: list[int], n: int) -> int:
    """Smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise AssertionError(f"{n} exceeds the largest bucket {buckets[-1]}")
