"""The native engine's KV cache: fixed slots, allocated once, reused for every request.

Legend (docs/conventions.md): Bc slots (max batch size), Tc positions per slot (max model length),
Nkv kv heads, Dh head dim, L layers; B rows of a prefill or decode step, T prompt tokens; local letter of
this file: R = B*Nkv (slot, kv head) rows.
Layout per layer is [Bc, Nkv, Tc, Dh] so that a decode step's read of slots [0, n) and positions
[0, kv_len) is a strided view whose (slot, head) batch dims collapse into one stride: batched matmuls
read it in place, with no gather or copy.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    """Preallocated K and V ``k/v_LBcNkvTcDh`` [L, Bc, Nkv, Tc, Dh] in ``dtype`` (attributes ``k``, ``v``)."""

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
        L, _, Nkv, _, Dh = self.k.shape
        return 2 * L * Nkv * Dh * self.k.element_size()

    def write_prefill(
        self, layer: int, slots_B: torch.Tensor, k_BNkvTDh: torch.Tensor, v_BNkvTDh: torch.Tensor
    ) -> None:
        """Store a prefill's K/V [B, Nkv, T, Dh] at positions [0, T) of ``slots_B`` (int [B])."""
        T = k_BNkvTDh.shape[2]
        self.k[layer, slots_B, :, :T] = k_BNkvTDh
        self.v[layer, slots_B, :, :T] = v_BNkvTDh

    def write_decode(self, layer: int, pos_B: torch.Tensor, k_BNkvDh: torch.Tensor, v_BNkvDh: torch.Tensor) -> None:
        """Store one token per slot 0..B-1 at position ``pos_B[b]`` (graph-capturable index_put_)."""
        B, Nkv, Dh = k_BNkvDh.shape
        rows_R = torch.arange(B * Nkv, device=pos_B.device)
        pos_R = pos_B[:, None].expand(B, Nkv).reshape(-1)  # no host sync, unlike repeat_interleave
        k_RTcDh = self.k[layer, :B].reshape(B * Nkv, self.max_len, Dh)
        v_RTcDh = self.v[layer, :B].reshape(B * Nkv, self.max_len, Dh)
        k_RTcDh.index_put_((rows_R, pos_R), k_BNkvDh.reshape(B * Nkv, Dh))
        v_RTcDh.index_put_((rows_R, pos_R), v_BNkvDh.reshape(B * Nkv, Dh))

    def copy_prefix(self, src_B: torch.Tensor, dst_B: torch.Tensor, num_tokens: int) -> None:
        """Copy positions [0, num_tokens) of slots ``src_B`` into slots ``dst_B`` (int [B] each), all layers
        (prefix sharing: a GRPO group's prompt is prefilled once). Costs a copy, not a prefill; the memory
        is still one slot per sequence (block sharing would need a paged cache)."""
        self.k[:, dst_B, :, :num_tokens] = self.k[:, src_B, :, :num_tokens]
        self.v[:, dst_B, :, :num_tokens] = self.v[:, src_B, :, :num_tokens]

    def read(self, layer: int, num_rows: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of K and V [num_rows, Nkv, kv_len, Dh] (slots 0..num_rows-1)."""
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
