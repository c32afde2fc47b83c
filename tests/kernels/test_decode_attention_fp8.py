"""Decode attention over an FP8 KV cache (``--inference.kv_cache_dtype fp8``): float8 e4m3 K/V with an fp32 scale per
(position, kv head), dequantized in the Triton kernel, against the PyTorch reference (which dequantizes first), slot
and paged layouts; opcheck; the input checks.

CPU runs Triton under TRITON_INTERPRET=1 with 16-position tiles (ragged tails, several splits); with CUDA the same
tests run on the GPU. The quantization itself (round-trip bounds, the cache writes) is tests/unit/test_fp8_kv_cache.py.
"""

from __future__ import annotations

import pytest
import torch
from prime_spmd.kernels.decode_attention.op import decode_attention, fused_decode_attention, paged_decode_attention
from prime_spmd.kernels.decode_attention.reference import FP8_DTYPE, quantize_kv

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
# fp32 q: the kernel multiplies the fp32 scores by the k scale and p by the v scale; the reference multiplies K/V
# first. Measured 7.0e-8 of max |ref| (slot grid), 1.9e-7 (paged grid), interpreter
FP32_RTOL = 2e-6
# bf16 q, output rounded to bf16 (e4m3 -> bf16 is exact; on GPU p * v_scale is rounded to bf16 before p @ v).
# Measured 5.1e-3 of max |ref| (slot grid), 6.4e-3 (paged grid), interpreter: about one bf16 ulp
BF16_RTOL = 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _quantized_layer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [S, Nkv, P, Dh] quantized as layer 1 of a 2-layer cache (strided views, like the engine's)."""
    x8, s = quantize_kv(x)
    k8 = torch.zeros(2, *x8.shape, dtype=FP8_DTYPE, device=x.device)
    sc = torch.zeros(2, *s.shape, device=x.device)
    k8[1], sc[1] = x8, s
    return k8[1], sc[1]


def _slot_case(b, h, j, d, s, length, max_len, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, d, generator=gen)
    # per-position magnitudes over three decades: one shared scale would lose the small ones
    mag = torch.exp(torch.randn(s, j, length, 1, generator=gen) * 2)
    k = torch.randn(s, j, length, d, generator=gen) * mag
    v = torch.randn(s, j, length, d, generator=gen) * mag.flip(2)
    lens = torch.randint(1, max_len + 6, (b,), generator=gen)
    lens[0] = 1
    if b > 1:
        lens[1] = max_len + 3
    (k8, ks), (v8, vs) = _quantized_layer(k.to(device)), _quantized_layer(v.to(device))
    return q.to(device), k8, v8, ks, vs, lens.to(device)


SHAPES = [
    # b, h, j, d, s, length, max_len
    (3, 4, 2, 16, 4, 64, 50),  # GQA, ragged tail, a row beyond max_len
    (2, 5, 5, 24, 2, 40, 40),  # MHA, Dh not a power of two
    (1, 16, 1, 16, 1, 130, 130),  # one row, G=16, splits over 9 tiles
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_fp8_matches_reference(device, shape, num_splits, dtype):
    q, k8, v8, ks, vs, lens = _slot_case(*shape, device)
    q = q.to(dtype)
    scale, max_len = shape[3] ** -0.5, shape[-1]
    ref = decode_attention(q, k8, v8, lens, max_len, scale, "reference", k_scale=ks, v_scale=vs)
    got = decode_attention(q, k8, v8, lens, max_len, scale, "triton", num_splits, k_scale=ks, v_scale=vs)
    assert got.dtype == dtype and got.shape == ref.shape
    assert _rel(got, ref) < (FP32_RTOL if dtype == torch.float32 else BF16_RTOL), _rel(got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_slot_fp8_reads_only_each_rows_positions_and_scales(device):
    """NaN scales (and NaN e4m3 values) past each row's length: the kernel must not read them."""
    q, k8, v8, ks, vs, lens = _slot_case(3, 4, 2, 16, 4, 64, 50, device, seed=3)
    ref = decode_attention(q, k8, v8, lens, 50, 0.25, "reference", k_scale=ks, v_scale=vs)
    for b, n in enumerate(lens.clamp(max=50).tolist()):
        ks[b, :, n:], vs[b, :, n:] = float("nan"), float("nan")
        k8.view(torch.uint8)[b, :, n:] = 0x7F  # e4m3fn NaN
    got = decode_attention(q, k8, v8, lens, 50, 0.25, "triton", 3, k_scale=ks, v_scale=vs)
    assert torch.isfinite(got).all() and _rel(got, ref) < FP32_RTOL


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_differs_from_ignoring_a_scale(device):
    """The scales matter: the kernel's output with one scale doubled is far off the reference (a check that the
    tolerances above would catch a broken scale)."""
    q, k8, v8, ks, vs, lens = _slot_case(2, 4, 2, 16, 2, 48, 48, device, seed=5)
    ref = decode_attention(q, k8, v8, lens, 48, 0.25, "reference", k_scale=ks, v_scale=vs)
    assert _rel(decode_attention(q, k8, v8, lens, 48, 0.25, "triton", k_scale=ks, v_scale=2 * vs), ref) > 0.3
    assert _rel(decode_attention(q, k8, v8, lens, 48, 0.25, "triton", k_scale=2 * ks, v_scale=vs), ref) > 1e-2


def _paged_case(b, h, j, d, sb, max_len, device, seed=0):
    """q, pools [Nb, Nkv, Sb, Dh] quantized (one layer of a 2-layer pool), a random table (rows share blocks,
    scrambled, repeated), lens as the slot case."""
    gen = torch.Generator().manual_seed(seed)
    mb = -(-max_len // sb) + 1
    nb = max(2, b * mb // 2)
    q = torch.randn(b, h, d, generator=gen)
    mag = torch.exp(torch.randn(nb, j, sb, 1, generator=gen) * 2)
    k = torch.randn(nb, j, sb, d, generator=gen) * mag
    v = torch.randn(nb, j, sb, d, generator=gen) / mag
    table = torch.randint(0, nb, (b + 1, mb), generator=gen, dtype=torch.int32)
    lens = torch.randint(1, max_len + 6, (b,), generator=gen)
    lens[0] = 1
    (k8, ks), (v8, vs) = _quantized_layer(k.to(device)), _quantized_layer(v.to(device))
    return q.to(device), k8, v8, ks, vs, table.to(device), lens.to(device)


PAGED_SHAPES = [
    # b, h, j, d, sb, max_len (interpreter tile: 16 positions)
    (3, 4, 2, 16, 16, 50),  # one block per tile
    (2, 5, 5, 24, 8, 40),  # two blocks per tile
    (4, 10, 2, 32, 24, 77),  # tiles straddle blocks
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", PAGED_SHAPES)
@pytest.mark.parametrize("num_splits", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_fp8_matches_reference(device, shape, num_splits, dtype):
    q, k8, v8, ks, vs, table, lens = _paged_case(*shape, device)
    q = q.to(dtype)
    scale, max_len = shape[3] ** -0.5, shape[-1]
    ref = paged_decode_attention(q, k8, v8, table, lens, max_len, scale, "reference", k_scale=ks, v_scale=vs)
    got = paged_decode_attention(q, k8, v8, table, lens, max_len, scale, "triton", num_splits, ks, vs)
    assert _rel(got, ref) < (FP32_RTOL if dtype == torch.float32 else BF16_RTOL), _rel(got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_fp8_equals_slot_fp8_on_the_same_data(device):
    """One sequence per slot laid out in blocks of 8: the paged kernel gives the slot kernel's output bit for bit."""
    q, k8, v8, ks, vs, lens = _slot_case(3, 4, 2, 16, 3, 48, 48, device, seed=7)
    sb, mb = 8, 6

    def pool(x):  # [3, Nkv, 48, ...] -> [18, Nkv, 8, ...], slot b's block m at b * 6 + m
        return x.unflatten(2, (mb, sb)).transpose(1, 2).flatten(0, 1).contiguous()

    table = torch.arange(3 * mb, dtype=torch.int32, device=device).view(3, mb)
    slot = decode_attention(q, k8, v8, lens, 48, 0.25, "triton", 1, k_scale=ks, v_scale=vs)
    paged = paged_decode_attention(q, pool(k8), pool(v8), table, lens, 48, 0.25, "triton", 1, pool(ks), pool(vs))
    assert torch.equal(slot, paged)


# opcheck's test_schema multiplies every tensor input, which has no float8 kernel on CPU (torch 2.13)
OPCHECK_UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_opcheck(device):
    q, k8, v8, ks, vs, lens = _slot_case(2, 4, 2, 16, 2, 40, 40, device)
    args = (q, k8, v8, lens, 40, 0.25, 0, ks, vs)
    torch.library.opcheck(torch.ops.prime_spmd.decode_attention, args, test_utils=OPCHECK_UTILS)
    q, k8, v8, ks, vs, table, lens = _paged_case(2, 4, 2, 16, 8, 40, device)
    args = (q, k8, v8, table, lens, 40, 0.25, 0, ks, vs)
    torch.library.opcheck(torch.ops.prime_spmd.paged_decode_attention, args, test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_bad_inputs_raise(device):
    q, k8, v8, ks, vs, lens = _slot_case(2, 4, 2, 16, 2, 40, 40, device)
    with pytest.raises(ValueError, match="float8 k/v need k_scale and v_scale"):
        decode_attention(q, k8, v8, lens, 40, 0.25, "triton")
    with pytest.raises(ValueError, match=r"scales must be float32 \[2, 2, 40\]"):
        decode_attention(q, k8, v8, lens, 40, 0.25, "triton", k_scale=ks[:, :, :20], v_scale=vs)
    with pytest.raises(ValueError, match="scales must be float32"):
        decode_attention(q, k8, v8, lens, 40, 0.25, "triton", k_scale=ks.half(), v_scale=vs)
    with pytest.raises(ValueError, match="strides differ"):
        decode_attention(
            q, k8, v8, lens, 40, 0.25, "triton", k_scale=ks, v_scale=vs.transpose(0, 1).contiguous().transpose(0, 1)
        )
    with pytest.raises(ValueError, match="k_scale / v_scale are for float8 k/v"):
        decode_attention(q, k8.float(), v8.float(), lens, 40, 0.25, "triton", k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="dtypes differ"):
        decode_attention(q, k8, v8.float(), lens, 40, 0.25, "triton", k_scale=ks, v_scale=vs)
    qkv = torch.randn(2, (4 + 2 * 2) * 16, device=device)
    cos, pos = torch.ones(2, 16, device=device), torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="fused_decode_attention: float8 caches are not taken"):
        fused_decode_attention(qkv, 4, None, None, cos, cos, pos, k8, v8, None, lens, 40, 0.25, 1e-6, "triton")
