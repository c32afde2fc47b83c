"""Causal grouped-query attention over packed sequences.

Document boundaries come from ``position_ids``: a token whose position is not the previous position
plus one starts a new document (the rule HF's ``find_packed_sequence_indices`` uses), so packed
micro-batches need no extra inputs and attention never crosses documents.

Backends: flash-attn's varlen kernel when installed (CUDA, bf16/fp16); else SDPA, with ``is_causal``
for unpacked rows (GQA native) and a block-diagonal causal bool mask when a row holds several documents
(k/v expanded to the query heads: masked GQA would fall back to SDPA's math backend on CUDA). A caller may
instead pass its own bool mask (the trainer's prompt sharing, ``trainer/packing.py: ShareLayout``); SDPA
then runs with that mask and position_ids only place RoPE.

SDPA's backends are limited to ``SDPA_BACKENDS`` (flash, memory-efficient, math: not cuDNN). torch 2.11 on
Hopper sends masked SDPA to cuDNN first, and cuDNN builds an execution plan for every new shape (hundreds
of ms, forward and backward); RL micro-batches change shape every step (H200, prime_spmd rl at the
Qwen3-0.6B shape: train steps of 0.1 s when a shape repeated, 0.25-0.3 s when it did not; 2026-12-03).

Legend (docs/conventions.md): B batch, T tokens, N query heads, Nkv kv heads, Dh head dim, S documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # optional dependency (CUDA only)
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None


SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The SDPA backends attention() lets torch choose from, in torch's own priority order (module docstring)."""


MASK_ALIGN = 8
"""Row stride, in elements, of the additive mask ``additive_mask`` makes: SDPA's memory-efficient CUDA path uses a
bias whose strides are multiples of 8 as it is, and pads a copy of any other in every call (``preprocess_mask``)."""


def additive_mask(mask_BTT: torch.Tensor, dtype: torch.dtype, groups: int = 1) -> torch.Tensor:
    """[B, 1, groups x T, T] in ``dtype``: 0 where the bool ``mask_BTT`` attends, -inf elsewhere, its rows repeated
    for each of ``groups`` query heads that share a key/value head (row j x T + t: query t of the j-th head of a group;
    ``_sdpa`` folds those heads into the query length). SDPA turns a bool mask into this in every call and keeps that
    copy for its backward: one a layer (28 at Qwen3-0.6B's depth: up to 28 x 128 MiB at ``share_layout``'s mask
    cap). Made once a forward, every layer's SDPA reads and saves the same tensor: the same values (0 added to a
    score is exact). Rows strided to the multiple of ``MASK_ALIGN`` above T: always a view of a wider buffer, so
    that compiled blocks see one layout whatever T is (a contiguous mask at some lengths compiled a second graph)."""
    B, T, _ = mask_BTT.shape
    width = (T // MASK_ALIGN + 1) * MASK_ALIGN
    buf = torch.full((B, 1, groups, T, width), float("-inf"), dtype=dtype, device=mask_BTT.device)
    view = buf[..., :T]
    view.masked_fill_(mask_BTT[:, None, None], 0.0)
    return view.view(B, 1, groups * T, T)


@dataclass(slots=True)
class AttnContext:
    """Per-forward attention metadata, built once and shared by all layers."""

    mask_B1TT: torch.Tensor | None = None
    """SDPA mask when rows are packed: additive (``additive_mask``, the compute dtype; [B, 1, g x T, T], its rows
    repeated for the g query heads of a key/value head) from ``build_attn_context``; a bool one [B, 1, T, T]
    (True = attend) is taken too."""
    cu_seqlens_S1: torch.Tensor | None = None  # flash-attn varlen: int32 document offsets over B*T tokens
    max_seqlen: int = 0


def document_starts(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """Bool [B, T]: True where a new document starts (first token of a row, or position not prev + 1)."""
    starts_BT = torch.ones_like(position_ids_BT, dtype=torch.bool)
    starts_BT[:, 1:] = position_ids_BT[:, 1:] - position_ids_BT[:, :-1] != 1
    return starts_BT


def build_attn_context(
    position_ids_BT: torch.Tensor,
    dtype: torch.dtype,
    use_flash: bool = True,
    attn_mask_BTT: torch.Tensor | None = None,
    query_groups: int = 1,
) -> AttnContext:
    """Attention metadata for ``position_ids``; syncs with the host once (packed or not, max length).
    ``attn_mask_BTT``: an explicit bool mask [B, T, T] (True = query t attends key t'), used as given
    (no causal rule added; each query must attend at least one key, else SDPA returns NaN). Masks are handed to
    the layers additive, in ``dtype``, their rows repeated for the ``query_groups`` query heads of a key/value head
    (``additive_mask``)."""
    if attn_mask_BTT is not None:
        B, T = position_ids_BT.shape
        if attn_mask_BTT.shape != (B, T, T) or attn_mask_BTT.dtype != torch.bool:
            raise ValueError(
                f"attn_mask must be bool [{B}, {T}, {T}], got {attn_mask_BTT.dtype} {list(attn_mask_BTT.shape)}"
            )
        return AttnContext(mask_B1TT=additive_mask(attn_mask_BTT, dtype, query_groups))
    starts_BT = document_starts(position_ids_BT)
    on_flash = (
        use_flash
        and flash_attn_varlen_func is not None
        and position_ids_BT.is_cuda
        and dtype in (torch.bfloat16, torch.float16)
    )
    if on_flash:
        start_idx_S = torch.nonzero(starts_BT.flatten()).flatten()
        total = torch.tensor([starts_BT.numel()], device=start_idx_S.device)
        cu_S1 = torch.cat([start_idx_S, total]).to(torch.int32)
        return AttnContext(cu_seqlens_S1=cu_S1, max_seqlen=int((cu_S1[1:] - cu_S1[:-1]).max()))
    if not bool(starts_BT[:, 1:].any()):
        return AttnContext()
    doc_BT = starts_BT.cumsum(-1)
    T = position_ids_BT.shape[1]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=position_ids_BT.device).tril()
    mask_BTT = (doc_BT[:, :, None] == doc_BT[:, None, :]) & causal_TT
    return AttnContext(mask_B1TT=additive_mask(mask_BTT, dtype, query_groups))


def attention(
    q_BTNDh: torch.Tensor, k_BTNkvDh: torch.Tensor, v_BTNkvDh: torch.Tensor, ctx: AttnContext
) -> torch.Tensor:
    """Causal GQA within documents; q [B, T, N, Dh], k/v [B, T, Nkv, Dh] -> [B, T, N, Dh]; scale 1/sqrt(Dh)."""
    B, T, N, Dh = q_BTNDh.shape
    if ctx.cu_seqlens_S1 is not None:
        out = flash_attn_varlen_func(
            q_BTNDh.reshape(B * T, N, Dh),
            k_BTNkvDh.reshape(B * T, -1, Dh),
            v_BTNkvDh.reshape(B * T, -1, Dh),
            ctx.cu_seqlens_S1,
            ctx.cu_seqlens_S1,
            ctx.max_seqlen,
            ctx.max_seqlen,
            causal=True,
        )
        return out.view(B, T, N, Dh)
    q_BNTDh, k_BNkvTDh, v_BNkvTDh = (t.transpose(1, 2) for t in (q_BTNDh, k_BTNkvDh, v_BTNkvDh))
    with sdpa_kernel(SDPA_BACKENDS):
        return _sdpa(q_BNTDh, k_BNkvTDh, v_BNkvTDh, ctx).transpose(1, 2)


def _sdpa(q_BNTDh: torch.Tensor, k_BNkvTDh: torch.Tensor, v_BNkvTDh: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
    B, N, T, Dh = q_BNTDh.shape
    if ctx.mask_B1TT is None:
        out_BNTDh = F.scaled_dot_product_attention(q_BNTDh, k_BNkvTDh, v_BNkvTDh, is_causal=True, enable_gqa=True)
    else:
        # With a mask, enable_gqa would send CUDA to SDPA's math backend (it materializes [B, N, T, T] scores in
        # fp32): the memory-efficient backend takes masks but not GQA. So the g query heads of a key/value head are
        # folded into the query length (q [B, Nkv, g x T, Dh], one copy, which SDPA keeps instead of q) against the
        # mask built with its rows repeated g times; a bool mask [B, 1, T, T] expands k/v to N heads instead (copies
        # SDPA keeps a layer). Same forward values (CPU: bit for bit, tests/unit).
        Nkv = k_BNkvTDh.shape[1]
        g = N // Nkv
        mask = ctx.mask_B1TT
        if mask.dtype not in (torch.bool, q_BNTDh.dtype):  # built in another dtype than the blocks compute in
            mask = mask.to(q_BNTDh.dtype)
        if g > 1 and mask.shape[-2] == g * T:
            q_BNkvGTDh = q_BNTDh.reshape(B, Nkv, g * T, Dh)
            out = F.scaled_dot_product_attention(q_BNkvGTDh, k_BNkvTDh, v_BNkvTDh, attn_mask=mask)
            return out.reshape(B, N, T, Dh)
        if mask.shape[-2] != T:
            raise ValueError(f"attention: a mask of {mask.shape[-2]} query rows for {g} heads a kv head x {T} tokens")
        k_BNTDh, v_BNTDh = (t[:, :, None].expand(B, Nkv, g, T, Dh).reshape(B, N, T, Dh) for t in (k_BNkvTDh, v_BNkvTDh))
        out_BNTDh = F.scaled_dot_product_attention(q_BNTDh, k_BNTDh, v_BNTDh, attn_mask=mask)
    return out_BNTDh
