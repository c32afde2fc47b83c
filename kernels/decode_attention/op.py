"""The entry points the native engine uses: ``decode_attention(..., impl=...)`` over a slot cache and
``paged_decode_attention(..., impl=...)`` over a paged pool and block table.

``reference``: pure PyTorch (reference.py), any device. ``triton``: the flash-decoding kernels
(kernel.py) as the ``torch.library`` ops ``prime_spmd::decode_attention`` and
``prime_spmd::paged_decode_attention``, with fake impls so they sit inside ``torch.compile(fullgraph=True)``
and CUDA-graph capture. Inference only: no backward is registered, so a backward through a triton op raises.

FP8 K/V (``--inference.kv_cache_dtype fp8``): the slot and paged forms take float8 e4m3 k/v with their fp32 scales
``k_scale``/``v_scale`` (the cache's shape without Dh; reference.quantize_kv) and dequantize in the kernel; the fused
form takes the model dtype only.

Legend: see reference.py (B rows, N query heads, Nkv kv heads, Dh head dim, Bc cache slots, Tc cache length,
Nb pool blocks, Sb positions per block, Mb table entries per row).
"""

from __future__ import annotations

from typing import Literal

import torch
from prime_spmd.kernels.decode_attention.reference import (
    FP8_DTYPE,
    decode_attention_reference,
    fused_decode_attention_reference,
    paged_decode_attention_reference,
)

DecodeAttentionImpl = Literal["reference", "triton"]


def _check_common(
    name: str, q_BNDh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens_B: torch.Tensor, max_len: int, layout: str
) -> None:
    """The checks both layouts share: q [B, N, Dh] against a 4-d k/v (``layout`` names its dims), lens, dtypes."""
    if q_BNDh.ndim != 3 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"{name}: want q [B, N, Dh] and k, v {layout}; got q {tuple(q_BNDh.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    (B, N, Dh), (_, Nkv, _, Dh_k) = q_BNDh.shape, k.shape
    if Dh_k != Dh or N % Nkv:
        raise ValueError(
            f"{name}: q {tuple(q_BNDh.shape)} does not fit k/v {tuple(k.shape)} (need the same Dh, N a multiple of Nkv)"
        )
    if max_len < 1:
        raise ValueError(f"{name}: max_len={max_len} must be >= 1")
    if lens_B.shape != (B,) or lens_B.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: lens_B must be int32/int64 [{B}], got {lens_B.dtype} {tuple(lens_B.shape)}")
    if k.dtype != v.dtype or (k.dtype != q_BNDh.dtype and k.dtype != FP8_DTYPE):
        raise ValueError(f"{name}: dtypes differ: q {q_BNDh.dtype}, k {k.dtype}, v {v.dtype} (k/v: q's or float8 e4m3)")


def check_scales(name: str, k: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """FP8 k/v need fp32 scales ``k_scale``, ``v_scale`` of k's shape without Dh, one set of strides for both (the
    kernel indexes them alike), on k's device; other k/v take none. ValueError naming what is wrong."""
    if k.dtype != FP8_DTYPE:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{name}: k_scale / v_scale are for float8 k/v, not {k.dtype}")
        return
    if k_scale is None or v_scale is None:
        raise ValueError(f"{name}: float8 k/v need k_scale and v_scale")
    want = tuple(k.shape[:-1])
    for s in (k_scale, v_scale):
        if tuple(s.shape) != want or s.dtype != torch.float32 or s.device != k.device:
            raise ValueError(
                f"{name}: scales must be float32 {list(want)} on {k.device}, got {s.dtype} {tuple(s.shape)} on "
                f"{s.device}"
            )
    if k_scale.stride() != v_scale.stride():
        raise ValueError(f"{name}: k_scale and v_scale strides differ ({k_scale.stride()}, {v_scale.stride()})")


def check_inputs(
    q_BNDh: torch.Tensor,
    k_BcNkvTcDh: torch.Tensor,
    v_BcNkvTcDh: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
):
    """ValueError naming the bad shape, dtype or size (host-side metadata only: no device sync)."""
    _check_common("decode_attention", q_BNDh, k_BcNkvTcDh, v_BcNkvTcDh, lens_B, max_len, "[Bc, Nkv, Tc, Dh]")
    check_scales("decode_attention", k_BcNkvTcDh, k_scale, v_scale)
    B, (Bc, _, Tc, _) = q_BNDh.shape[0], k_BcNkvTcDh.shape
    if B > Bc:
        raise ValueError(f"decode_attention: {B} rows, more than the cache's {Bc} slots")
    if max_len > Tc:
        raise ValueError(f"decode_attention: max_len={max_len} outside [1, {Tc}] (the cache length)")


def decode_attention(
    q_BNDh: torch.Tensor,
    k_BcNkvTcDh: torch.Tensor,
    v_BcNkvTcDh: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    impl: DecodeAttentionImpl = "reference",
    num_splits: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [B, N, Dh] over positions [0, min(lens_B[b], max_len)) of cache slot b; [B, N, Dh].

    ``k/v_BcNkvTcDh`` [Bc, Nkv, Tc, Dh], N = G Nkv, q's dtype or float8 e4m3 with ``k_scale``/``v_scale`` fp32
    [Bc, Nkv, Tc]; ``lens_B`` int [B] on q's device, each >= 1; ``max_len`` a static bound (the triton grid is
    sized by it; a longer length is clamped to it). ``num_splits`` (triton): length splits per (row, kv head), 0 =
    chosen by shape. No side effects.
    """
    check_inputs(q_BNDh, k_BcNkvTcDh, v_BcNkvTcDh, lens_B, max_len, k_scale, v_scale)
    if impl == "reference":
        return decode_attention_reference(q_BNDh, k_BcNkvTcDh, v_BcNkvTcDh, lens_B, max_len, scale, k_scale, v_scale)
    if impl == "triton":
        return torch.ops.prime_spmd.decode_attention(
            q_BNDh, k_BcNkvTcDh, v_BcNkvTcDh, lens_B, max_len, scale, num_splits, k_scale, v_scale
        )
    raise ValueError(f"unknown decode attention impl {impl!r}; choose reference or triton")


@torch.library.custom_op("prime_spmd::decode_attention", mutates_args=())
def decode_attention_op(
    q_BNDh: torch.Tensor,
    k_BcNkvTcDh: torch.Tensor,
    v_BcNkvTcDh: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    num_splits: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernels (kernel.decode_attention); inputs as ``decode_attention`` above."""
    from prime_spmd.kernels.decode_attention import kernel

    return kernel.decode_attention(q_BNDh, k_BcNkvTcDh, v_BcNkvTcDh, lens_B, max_len, scale, num_splits,
                                   k_scale=k_scale, v_scale=v_scale)  # fmt: skip


@decode_attention_op.register_fake
def _(q_BNDh, k_BcNkvTcDh, v_BcNkvTcDh, lens_B, max_len, scale, num_splits, k_scale=None, v_scale=None):
    return torch.empty_like(q_BNDh)


def check_paged_inputs(
    q_BNDh: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
):
    """ValueError naming the bad shape, dtype, device or size (host-side metadata only: no device sync, so the
    block ids themselves are not checked)."""
    _check_common("paged_decode_attention", q_BNDh, k_pool, v_pool, lens_B, max_len, "[Nb, Nkv, Sb, Dh]")
    check_scales("paged_decode_attention", k_pool, k_scale, v_scale)
    B, Sb = q_BNDh.shape[0], k_pool.shape[2]
    if block_table.ndim != 2 or block_table.dtype != torch.int32 or block_table.shape[0] < B:
        raise ValueError(
            f"paged_decode_attention: block_table must be int32 [Bc, Mb] with Bc >= B = {B}, got "
            f"{block_table.dtype} {tuple(block_table.shape)}"
        )
    if block_table.device != q_BNDh.device or lens_B.device != q_BNDh.device:
        raise ValueError(
            f"paged_decode_attention: block_table ({block_table.device}) and lens_B ({lens_B.device}) must be on "
            f"q's device ({q_BNDh.device})"
        )
    Mb = block_table.shape[1]
    if max_len > Mb * Sb:
        raise ValueError(
            f"paged_decode_attention: max_len={max_len} outside [1, {Mb * Sb}] (Mb * Sb: {Mb} table entries of "
            f"{Sb}-position blocks)"
        )


def paged_decode_attention(
    q_BNDh: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    impl: DecodeAttentionImpl = "reference",
    num_splits: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``decode_attention`` over a paged cache: q [B, N, Dh] attends positions [0, min(lens_B[b], max_len)) of row
    b, whose position t is ``pool[block_table[b, t // Sb], :, t % Sb]``; [B, N, Dh].

    ``k/v_pool`` [Nb, Nkv, Sb, Dh] (one layer of the engine's [L, Nb, Nkv, Sb, Dh] pools: any strides, head dim
    contiguous for triton); ``block_table`` int32 [Bc, Mb] on q's device, Bc >= B, rows may share blocks, no block
    id is special; the entries a row reads (its first ceil(min(lens_B[b], max_len) / Sb)) must be in [0, Nb),
    which is not checked (it would sync). ``lens_B``, ``max_len`` (<= Mb * Sb), ``num_splits`` as
    ``decode_attention``; float8 pools come with ``k_scale``/``v_scale`` fp32 [Nb, Nkv, Sb]. No side effects.
    """
    check_paged_inputs(q_BNDh, k_pool, v_pool, block_table, lens_B, max_len, k_scale, v_scale)
    if impl == "reference":
        return paged_decode_attention_reference(q_BNDh, k_pool, v_pool, block_table, lens_B, max_len, scale,
                                                k_scale, v_scale)  # fmt: skip
    if impl == "triton":
        return torch.ops.prime_spmd.paged_decode_attention(
            q_BNDh, k_pool, v_pool, block_table, lens_B, max_len, scale, num_splits, k_scale, v_scale
        )
    raise ValueError(f"unknown decode attention impl {impl!r}; choose reference or triton")


@torch.library.custom_op("prime_spmd::paged_decode_attention", mutates_args=())
def paged_decode_attention_op(
    q_BNDh: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    num_splits: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernels (kernel.paged_decode_attention); inputs as ``paged_decode_attention`` above."""
    from prime_spmd.kernels.decode_attention import kernel

    return kernel.paged_decode_attention(q_BNDh, k_pool, v_pool, block_table, lens_B, max_len, scale, num_splits,
                                         k_scale=k_scale, v_scale=v_scale)  # fmt: skip


@paged_decode_attention_op.register_fake
def _(q_BNDh, k_pool, v_pool, block_table, lens_B, max_len, scale, num_splits, k_scale=None, v_scale=None):
    return torch.empty_like(q_BNDh)


def check_fused_inputs(
    qkv_BP: torch.Tensor,
    num_heads: int,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    cos_BDh: torch.Tensor,
    sin_BDh: torch.Tensor,
    pos_B: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    lens_B: torch.Tensor,
    max_len: int,
) -> None:
    """ValueError naming the bad shape or dtype (host metadata only): the cache as ``check_inputs`` /
    ``check_paged_inputs`` check it, then the QKV row width, the norm weights, cos/sin and positions."""
    if k_cache.dtype == FP8_DTYPE:
        raise ValueError(
            "fused_decode_attention: float8 caches are not taken (the new token's quantized write is not in the "
            "kernel); --inference.kv_cache_dtype fp8 runs the triton attention with the write before it"
        )
    B, Nkv, Dh = qkv_BP.shape[0], k_cache.shape[1], k_cache.shape[-1]
    q_view = qkv_BP.new_empty(()).expand(B, num_heads, Dh)  # shape-only stand-in for q: the checks read metadata
    if block_table is None:
        check_inputs(q_view, k_cache, v_cache, lens_B, max_len)
    else:
        check_paged_inputs(q_view, k_cache, v_cache, block_table, lens_B, max_len)
    if qkv_BP.ndim != 2 or qkv_BP.shape[1] != (num_heads + 2 * Nkv) * Dh or Dh % 2:
        raise ValueError(
            f"fused_decode_attention: qkv {tuple(qkv_BP.shape)} is not [B, (N + 2 Nkv) Dh] for N={num_heads}, "
            f"Nkv={Nkv}, even Dh={Dh}"
        )
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError("fused_decode_attention: pass both q_norm_w and k_norm_w, or neither")
    if q_norm_w is not None and not (q_norm_w.shape == k_norm_w.shape == (Dh,)):
        raise ValueError(
            f"fused_decode_attention: norm weights {tuple(q_norm_w.shape)}, {tuple(k_norm_w.shape)}, want [{Dh}]"
        )
    if not (cos_BDh.shape == sin_BDh.shape == (B, Dh)):
        raise ValueError(
            f"fused_decode_attention: cos/sin must be [B, Dh] = [{B}, {Dh}], got {tuple(cos_BDh.shape)}, "
            f"{tuple(sin_BDh.shape)}"
        )
    if pos_B.shape != (B,) or pos_B.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"fused_decode_attention: pos_B must be int32/int64 [{B}], got {pos_B.dtype} {tuple(pos_B.shape)}"
        )


def fused_decode_attention(
    qkv_BP: torch.Tensor,
    num_heads: int,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    cos_BDh: torch.Tensor,
    sin_BDh: torch.Tensor,
    pos_B: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    eps: float,
    impl: DecodeAttentionImpl = "reference",
    num_splits: int = 0,
) -> torch.Tensor:
    """The decode layer's attention from its QKV projection (q/k norm, RoPE, the new token's cache write, attention:
    reference.fused_decode_attention_reference is the spec); o [B, N, Dh], mutates the caches. Inputs checked by
    ``check_fused_inputs``."""
    check_fused_inputs(qkv_BP, num_heads, q_norm_w, k_norm_w, cos_BDh, sin_BDh, pos_B, k_cache, v_cache, block_table,
                       lens_B, max_len)  # fmt: skip
    args = (qkv_BP, num_heads, q_norm_w, k_norm_w, cos_BDh, sin_BDh, pos_B, k_cache, v_cache, block_table, lens_B,
            max_len, scale, eps)  # fmt: skip
    if impl == "reference":
        return fused_decode_attention_reference(*args)
    if impl == "triton":
        return torch.ops.prime_spmd.fused_decode_attention(*args, num_splits)
    raise ValueError(f"unknown decode attention impl {impl!r}; choose reference or triton")


@torch.library.custom_op("prime_spmd::fused_decode_attention", mutates_args=("k_cache", "v_cache"))
def fused_decode_attention_op(
    qkv_BP: torch.Tensor,
    num_heads: int,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    cos_BDh: torch.Tensor,
    sin_BDh: torch.Tensor,
    pos_B: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    lens_B: torch.Tensor,
    max_len: int,
    scale: float,
    eps: float,
    num_splits: int,
) -> torch.Tensor:
    """The Triton kernels (kernel.fused_decode_attention); inputs as ``fused_decode_attention`` above."""
    from prime_spmd.kernels.decode_attention import kernel

    return kernel.fused_decode_attention(
        qkv_BP, num_heads, q_norm_w, k_norm_w, cos_BDh, sin_BDh, pos_B, k_cache, v_cache, block_table, lens_B,
        max_len, scale, eps, num_splits,
    )  # fmt: skip


@fused_decode_attention_op.register_fake
def _(qkv_BP, num_heads, q_norm_w, k_norm_w, cos_BDh, sin_BDh, pos_B, k_cache, v_cache, block_table, lens_B, max_len,
      scale, eps, num_splits):  # fmt: skip
    return qkv_BP.new_empty(qkv_BP.shape[0], num_heads, k_cache.shape[-1])
