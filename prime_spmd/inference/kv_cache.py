"""The native engine's KV caches, allocated once and reused for every request.

- ``SlotKVCache`` (``--inference.native.kv_cache slot``): one fixed slot of Tc positions per sequence. Layout per layer
  [Bc, Nkv, Tc, Dh] so that a decode step's read of slots [0, n) and positions [0, kv_len) is a strided view whose
  (slot, head) batch dims collapse into one stride: batched matmuls read it in place, with no gather or copy.
- ``PagedKVCache`` (``--inference.native.kv_cache paged``): a pool of blocks of Sb positions and a block table per slot.
  A sequence holds the blocks its prompt + max_tokens can fill, not a whole slot, and a GRPO group's samples point
  at the same blocks for their shared prompt (only the prompt's last, partial block is copied per sample), so the
  KV memory of a group with a long prompt is about 1/group_size of the slot cache's.

Both store K/V in the model dtype (``--inference.kv_cache_dtype auto``) or in float8 e4m3 (``fp8``) with one fp32
scale per (position, kv head), set when the position is written (kernels/decode_attention/reference.py:
``quantize_kv``): 1 byte an element plus 4 bytes per Dh, so about twice the tokens in the same memory (bf16, Dh 128:
132 bytes against 256 per position and kv head). Scales ``k_scale``/``v_scale`` have the K/V layout without Dh.

Legend (docs/conventions.md): Bc slots (max batch size), Tc positions per slot (max model length),
Nkv kv heads, Dh head dim, L layers, Nb blocks of the paged pool, Sb positions per block, Mb block-table entries
per slot; B rows of a prefill or decode step, T prompt tokens.
"""

from __future__ import annotations

from typing import Literal

import torch

from prime_spmd.kernels.decode_attention.reference import FP8_DTYPE, dequantize_kv, quantize_kv
from prime_spmd.memory import kv_bytes_per_token

KVCacheDtype = Literal["auto", "fp8"]


def check_kv_cache_dtype(kv_dtype: str, device: torch.device, capability: tuple[int, int] | None = None) -> None:
    """ValueError naming ``--inference.kv_cache_dtype`` for an unknown value, or ``fp8`` on a CUDA device below
    compute capability 8.9 (no e4m3 conversion in hardware; ``capability`` overrides the query, for tests)."""
    if kv_dtype not in ("auto", "fp8"):
        raise ValueError(f"--inference.kv_cache_dtype {kv_dtype!r}: choose auto or fp8")
    if kv_dtype == "fp8" and device.type == "cuda":
        cap = capability or torch.cuda.get_device_capability(device)
        if tuple(cap) < (8, 9):
            raise ValueError(
                f"--inference.kv_cache_dtype fp8 needs a GPU of compute capability >= 8.9 (Ada, Hopper: e4m3 "
                f"conversion); {device} is {cap[0]}.{cap[1]}: use --inference.kv_cache_dtype auto"
            )


def write_token(
    cache_layer: torch.Tensor,
    table_BcMb: torch.Tensor | None,
    pos_B: torch.Tensor,
    x_BNkvDh: torch.Tensor,
    scale_layer: torch.Tensor | None = None,
) -> None:
    """Store one token per row b at position ``pos_B[b]`` of row b (row b = slot b); graph-capturable. One layer of
    either cache: slots [Bc, Nkv, Tc, Dh] (``table_BcMb`` None) or a paged pool [Nb, Nkv, Sb, Dh] and its table.
    A float8 cache layer comes with its ``scale_layer`` (its layout without Dh): ``x`` is quantized first."""
    rows_B = torch.arange(x_BNkvDh.shape[0], device=pos_B.device)
    if table_BcMb is None:
        at = (rows_B, slice(None), pos_B)
    else:
        sb = cache_layer.shape[2]
        at = (table_BcMb[rows_B, pos_B // sb], slice(None), pos_B % sb)
    if scale_layer is None:
        cache_layer[at] = x_BNkvDh
        return
    cache_layer[at], scale_layer[at] = quantize_kv(x_BNkvDh)


def read_positions(
    cache_layer: torch.Tensor,
    table_BcMb: torch.Tensor | None,
    num_rows: int,
    kv_len: int,
    scale_layer: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Positions [0, kv_len) of slots 0..num_rows-1, [B, Nkv, kv_len, Dh]: a view of slots (``table_BcMb`` None) or
    a paged pool's blocks gathered into that layout (a copy). A float8 layer with its ``scale_layer`` is returned
    dequantized, in ``dtype`` (a copy)."""
    if table_BcMb is None:
        x = cache_layer[:num_rows, :, :kv_len]
        s = None if scale_layer is None else scale_layer[:num_rows, :, :kv_len]
    else:
        _, nkv, sb, dh = cache_layer.shape
        mb = -(-kv_len // sb)
        blocks_BMb = table_BcMb[:num_rows, :mb]
        x = cache_layer[blocks_BMb].transpose(1, 2).reshape(num_rows, nkv, mb * sb, dh)[:, :, :kv_len]
        s = None
        if scale_layer is not None:
            s = scale_layer[blocks_BMb].transpose(1, 2).reshape(num_rows, nkv, mb * sb)[:, :, :kv_len]
    return x if s is None else dequantize_kv(x, s, dtype)


class _KVPair:
    """K and V tensors ``k``, ``v`` of one shape, zeroed, [L, slots or blocks, Nkv, positions, Dh] (with ``fp8``:
    float8 e4m3, and fp32 scales ``k_scale``, ``v_scale`` [L, slots or blocks, Nkv, positions]; else None), and
    what both caches do the same way through ``block_table`` (None for slots). ``dtype`` is the model's: what
    reads dequantize to."""

    block_table: torch.Tensor | None = None

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, kv_dtype: str) -> None:
        check_kv_cache_dtype(kv_dtype, device)
        self.dtype, self.kv_dtype, self._shape, self._device = dtype, kv_dtype, shape, device
        self.allocate()

    def allocate(self) -> None:
        """(Re)create the zeroed tensors (``NativeEngine`` frees them with ``free`` while the trainer steps)."""
        fp8 = self.kv_dtype == "fp8"
        store = FP8_DTYPE if fp8 else self.dtype
        self.k = torch.zeros(self._shape, dtype=store, device=self._device)
        self.v = torch.zeros(self._shape, dtype=store, device=self._device)
        self.k_scale = torch.zeros(self._shape[:-1], device=self._device) if fp8 else None
        self.v_scale = torch.zeros(self._shape[:-1], device=self._device) if fp8 else None

    def free(self) -> None:
        """Drop the tensors (``allocate`` brings them back, zeroed)."""
        self.k = self.v = self.k_scale = self.v_scale = None

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer ``layer``'s K and V scales (None, None without fp8)."""
        if self.k_scale is None:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def nbytes_per_token(self) -> int:
        """Bytes of K+V one token occupies across all layers (scales included)."""
        L, _, Nkv, _, Dh = self._shape
        return kv_bytes_per_token(L, Nkv, Dh, self.dtype.itemsize, self.kv_dtype)

    def nbytes_allocated(self) -> int:
        """Bytes of K and V (and their scales), all layers."""
        return sum(2 * t.numel() * t.element_size() for t in (self.k, self.k_scale) if t is not None)

    def write_decode(self, layer: int, pos_B: torch.Tensor, k_BNkvDh: torch.Tensor, v_BNkvDh: torch.Tensor) -> None:
        """Store one token per slot 0..B-1 at position ``pos_B[b]`` (graph-capturable; quantized under fp8)."""
        ks, vs = self.scales(layer)
        write_token(self.k[layer], self.block_table, pos_B, k_BNkvDh, ks)
        write_token(self.v[layer], self.block_table, pos_B, v_BNkvDh, vs)

    def read(self, layer: int, num_rows: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_rows, Nkv, kv_len, Dh] of slots 0..num_rows-1 in the model dtype (views of slots, gathered
        copies of blocks; dequantized copies under fp8)."""
        ks, vs = self.scales(layer)
        return (
            read_positions(self.k[layer], self.block_table, num_rows, kv_len, ks, self.dtype),
            read_positions(self.v[layer], self.block_table, num_rows, kv_len, vs, self.dtype),
        )

    def _store(self, layer: int, at: tuple, k_X: torch.Tensor, v_X: torch.Tensor) -> None:
        """K and V (any shape ending in Dh) at index ``at`` of layer ``layer``, quantized under fp8."""
        if self.k_scale is None:
            self.k[layer][at], self.v[layer][at] = k_X, v_X
            return
        self.k[layer][at], self.k_scale[layer][at] = quantize_kv(k_X)
        self.v[layer][at], self.v_scale[layer][at] = quantize_kv(v_X)

    def _copy(self, dst: tuple, src: tuple) -> None:
        """Entries ``src`` to ``dst`` (indices into [L, slots or blocks, Nkv, positions]) of K, V and their scales."""
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t[dst] = t[src]


class SlotKVCache(_KVPair):
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
        kv_dtype: KVCacheDtype = "auto",
    ) -> None:
        self._allocate((num_layers, num_slots, num_kv_heads, max_len, head_dim), dtype, device, kv_dtype)
        self.num_slots, self.max_len, self.num_kv_heads = num_slots, max_len, num_kv_heads

    def write_prefill(
        self, layer: int, slots_B: torch.Tensor, k_BNkvTDh: torch.Tensor, v_BNkvTDh: torch.Tensor
    ) -> None:
        """Store a prefill's K/V [B, Nkv, T, Dh] at positions [0, T) of ``slots_B`` (int [B])."""
        self._store(layer, (slots_B, slice(None), slice(0, k_BNkvTDh.shape[2])), k_BNkvTDh, v_BNkvTDh)

    def copy_prefix(self, src: list[int], dst: list[int], num_tokens: int) -> None:
        """Copy positions [0, num_tokens) of slots ``src`` into slots ``dst``, all layers (prefix sharing: a GRPO
        group's prompt is prefilled once). Costs a copy, not a prefill; the memory is still one slot per sequence
        (``PagedKVCache`` shares it)."""
        src_B, dst_B = torch.tensor(src, device=self.k.device), torch.tensor(dst, device=self.k.device)
        self._copy((slice(None), dst_B, slice(None), slice(0, num_tokens)),
                   (slice(None), src_B, slice(None), slice(0, num_tokens)))  # fmt: skip

    # The slot cache holds a whole slot per sequence from the start: nothing to reserve, release or publish.
    def reserve(self, slot: int, num_tokens: int, share_slot: int | None = None, num_shared: int = 0) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def sync(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        """Memory: ``kv_bytes_allocated`` (K and V and their scales, all layers)."""
        return {"kv_bytes_allocated": self.nbytes_allocated()}


class PagedKVCache(_KVPair):
    """K and V pools ``k``/``v`` [L, Nb, Nkv, Sb, Dh] and a block table ``block_table`` int32 [Bc, Mb] on the device.

    Slot b's position t lives at ``k[layer, block_table[b, t // Sb], :, t % Sb]``. Block 0 is scratch: the table's
    unassigned entries point at it, so the rows of free slots that a decode step still runs and prefill padding
    past a sequence's blocks write there, and no live row ever reads it. (The one extra row a sequence that stops
    on a token decodes was launched before its release: it writes inside the sequence's own blocks, at a position
    whoever gets the blocks next writes before reading, after that step on the stream.) The host keeps the allocator (free list, reference counts, a copy of the table) and
    ``sync`` publishes the table with one host->device copy: the engine calls it after ``reserve``/``release``
    and before the next prefill or decode step, so every device read sees the table of its own step (one stream).
    ``num_tokens`` sizes the pool (usable blocks, scratch excluded: ceil(num_tokens / Sb)); 0 gives Bc * Mb blocks,
    the slot cache's memory, so admission never waits for blocks; fewer bound the memory and make admission wait.
    """

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
        block_size: int = 16,
        num_tokens: int = 0,
        kv_dtype: KVCacheDtype = "auto",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"--inference.native.kv_block_size={block_size}: must be >= 1")
        if num_tokens < 0:
            raise ValueError(f"--inference.native.kv_cache_tokens={num_tokens}: must be >= 0 (0: slots x max length)")
        self.block_size = block_size
        self.blocks_per_slot = -(-max_len // block_size)
        self.num_blocks = -(-num_tokens // block_size) if num_tokens else num_slots * self.blocks_per_slot
        self._allocate((num_layers, self.num_blocks + 1, num_kv_heads, block_size, head_dim), dtype, device, kv_dtype)
        self.num_slots, self.max_len, self.num_kv_heads = num_slots, max_len, num_kv_heads
        self.block_table = torch.zeros(num_slots, self.blocks_per_slot, dtype=torch.int32, device=device)
        self._host_table = torch.zeros(num_slots, self.blocks_per_slot, dtype=torch.int32)
        self._dirty = False
        self._free = list(range(self.num_blocks, 0, -1))  # popped from the end: lowest ids first
        self._refs = [0] * (self.num_blocks + 1)
        self._owned: list[list[int]] = [[] for _ in range(num_slots)]
        self.peak_blocks_in_use = 0

    # ---- allocation (host) ----------------------------------------------------------------
    def blocks_for(self, num_tokens: int, num_shared: int = 0) -> int:
        """Blocks a sequence of ``num_tokens`` positions takes from the pool when its first ``num_shared`` positions
        are another sequence's (only whole blocks are shared)."""
        return -(-num_tokens // self.block_size) - num_shared // self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_blocks_in_use(self) -> int:
        return self.num_blocks - len(self._free)

    def reserve(self, slot: int, num_tokens: int, share_slot: int | None = None, num_shared: int = 0) -> None:
        """Give ``slot`` the blocks for positions [0, num_tokens): with ``share_slot``, the whole blocks of its first
        ``num_shared`` positions are ``share_slot``'s (reference-counted, written once by its prefill), the rest
        fresh. The caller checked ``blocks_for`` against ``num_free_blocks``; publish with ``sync``."""
        assert not self._owned[slot], f"slot {slot} still holds blocks"
        shared = self._owned[share_slot][: num_shared // self.block_size] if num_shared else []
        num_new = -(-num_tokens // self.block_size) - len(shared)
        assert num_new <= len(self._free), f"{num_new} blocks wanted, {len(self._free)} free"
        blocks = shared + [self._free.pop() for _ in range(num_new)]
        for b in blocks:
            self._refs[b] += 1
        self._owned[slot] = blocks
        self._host_table[slot, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self._dirty = True
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.num_blocks_in_use)

    def release(self, slot: int) -> None:
        """Return ``slot``'s blocks (those no other sequence shares go back to the free list); its table row points
        at the scratch block again. Publish with ``sync`` before the next step."""
        for b in self._owned[slot]:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
        self._owned[slot] = []
        self._host_table[slot] = 0
        self._dirty = True

    def sync(self) -> None:
        """Copy the host table to the device if it changed, stream-ordered after the steps already launched and
        without waiting for them: a blocking host->device copy would synchronize the stream and cost the engine its
        one-step lead. From a pinned snapshot, which torch's host allocator keeps until the copy has run, so later
        ``reserve``/``release`` calls cannot change what this copy sends."""
        if self._dirty:
            src = self._host_table.pin_memory() if self.block_table.is_cuda else self._host_table
            self.block_table.copy_(src, non_blocking=True)
            self._dirty = False

    def stats(self) -> dict[str, float]:
        """Memory: bytes allocated (K and V and their scales, all layers, scratch block included), blocks in use now
        and at peak."""
        per_block = self.nbytes_per_token() * self.block_size
        return {
            "kv_bytes_allocated": self.nbytes_allocated(),
            "kv_block_size": self.block_size,
            "kv_blocks": self.num_blocks,
            "kv_blocks_in_use": self.num_blocks_in_use,
            "kv_peak_blocks_in_use": self.peak_blocks_in_use,
            "kv_peak_bytes_in_use": self.peak_blocks_in_use * per_block,
        }

    # ---- device reads and writes ----------------------------------------------------------
    def write_prefill(
        self, layer: int, slots_B: torch.Tensor, k_BNkvTDh: torch.Tensor, v_BNkvTDh: torch.Tensor
    ) -> None:
        """Store a prefill's K/V [B, Nkv, T, Dh] at positions [0, T) of ``slots_B`` (int [B]); positions past a
        sequence's blocks (padding) land in the scratch block."""
        T = k_BNkvTDh.shape[2]
        pos_T = torch.arange(T, device=slots_B.device)
        blk_BT = self.block_table[slots_B[:, None], (pos_T // self.block_size)[None, :]]
        off_T = pos_T % self.block_size
        self._store(layer, (blk_BT, slice(None), off_T[None, :]), k_BNkvTDh.transpose(1, 2), v_BNkvTDh.transpose(1, 2))

    def copy_prefix(self, src: list[int], dst: list[int], num_tokens: int) -> None:
        """Prefix sharing's copy: ``reserve(dst, ..., share_slot=src, num_shared=num_tokens)`` already pointed the
        whole blocks of positions [0, num_tokens) at ``src``'s; copy the partial last one (all layers)."""
        full, rest = divmod(num_tokens, self.block_size)
        if rest == 0:
            return
        src_blk = self._host_table[src, full].to(self.k.device, non_blocking=True)  # fresh tensors: no one mutates them
        dst_blk = self._host_table[dst, full].to(self.k.device, non_blocking=True)
        self._copy(
            (slice(None), dst_blk, slice(None), slice(0, rest)), (slice(None), src_blk, slice(None), slice(0, rest))
        )


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
