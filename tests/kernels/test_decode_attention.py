"""Decode attention: the Triton kernels vs the PyTorch reference, opcheck, and CUDA-graph capture.

CPU runs Triton under TRITON_INTERPRET=1 (tests/conftest.py) with 16-position tiles, so the small
shapes still cover several tiles per split, ragged tails, splits that are empty for short rows,
non-power-of-two head dims and group sizes, MHA (G = 1) and GQA. With CUDA the same tests run on
the GPU (the interpreter is then off). ~10 s on CPU.
"""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention.op import decode_attention

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
# fp32: measured max error 1.3e-7 of max |ref| over the grid (interpreter); on GPU the dots are IEEE fp32 (no TF32)
FP32_RTOL = 2e-6
# bf16: q/k/v in bf16, output rounded to bf16, reference in fp32 on the same bf16 inputs:
# measured 3.6e-3 of max |ref| (interpreter), about one bf16 ulp; the GPU casts p to bf16 for p @ v too
BF16_RTOL = 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _case(b, h, j, d, s, length, max_len, dtype, device, seed=0):
    """q [b, h, d], K/V as one layer of a 2-layer cache [2, s, j, length, d] (a strided view, like the
    engine's), lens in [1, max_len + 5] with the edges 1 and > max_len (clamped) present."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, d, generator=gen).to(dtype)
    k = torch.randn(2, s, j, length, d, generator=gen).to(dtype)[1]
    v = torch.randn(2, s, j, length, d, generator=gen).to(dtype)[1]
    lens = torch.randint(1, max_len + 6, (b,), generator=gen)
    lens[0] = 1
    if b > 1:
        lens[1] = max_len + 3
    return q.to(device), k.to(device), v.to(device), lens.to(device)


SHAPES = [
    # b, h, j, d, s, length, max_len
    (3, 4, 2, 16, 4, 64, 50),  # GQA G=2, ragged tail, a row beyond max_len
    (2, 5, 5, 24, 2, 40, 40),  # MHA, D not a power of two, max_len = cache length
    (4, 10, 2, 32, 5, 96, 77),  # G=5 (not a power of two), several tiles per split
    (1, 16, 1, 16, 1, 130, 130),  # one row, G=16 (a full BLOCK_G), splits over 9 tiles
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_matches_reference_fp32(device, shape, num_splits):
    q, k, v, lens = _case(*shape, torch.float32, device)
    scale = shape[3] ** -0.5
    ref = decode_attention(q, k, v, lens, shape[-1], scale, impl="reference")
    got = decode_attention(q, k, v, lens, shape[-1], scale, impl="triton", num_splits=num_splits)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert _rel(got, ref) < FP32_RTOL, _rel(got, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_matches_reference_bf16(device, num_splits):
    shape = (4, 8, 2, 32, 4, 80, 70)
    q, k, v, lens = _case(*shape, torch.bfloat16, device, seed=1)
    ref = decode_attention(q, k, v, lens, 70, 0.2, impl="reference")
    got = decode_attention(q, k, v, lens, 70, 0.2, impl="triton", num_splits=num_splits)
    assert got.dtype == torch.bfloat16
    assert _rel(got, ref) < BF16_RTOL, _rel(got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_reads_only_each_rows_positions(device):
    """NaN in every cache position at or past a row's length (and in slots past B) must not reach o."""
    b, max_len = 3, 60
    q, k, v, lens = _case(b, 4, 2, 16, 5, 64, max_len, torch.float32, device, seed=2)
    clean = decode_attention(q, k, v, lens, max_len, 0.25, impl="reference")
    pos = torch.arange(k.shape[2], device=device)
    dead = pos[None, :] >= lens.clamp(max=max_len)[:, None]  # [b, length]
    kp, vp = k.clone(), v.clone()
    kp[:b].masked_fill_(dead[:, None, :, None], float("nan"))
    vp[:b].masked_fill_(dead[:, None, :, None], float("nan"))
    kp[b:], vp[b:] = float("nan"), float("nan")
    for ns in (1, 4):
        got = decode_attention(q, kp, vp, lens, max_len, 0.25, impl="triton", num_splits=ns)
        assert torch.isfinite(got).all()
        assert _rel(got, clean) < FP32_RTOL


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise(device):
    q, k, v, lens = _case(2, 4, 2, 16, 2, 32, 32, torch.float32, device)
    with pytest.raises(ValueError, match="max_len=33"):
        decode_attention(q, k, v, lens, 33, 1.0, impl="triton")
    with pytest.raises(ValueError, match="N a multiple of Nkv"):
        decode_attention(q[:, :3], k, v, lens, 32, 1.0, impl="triton")
    with pytest.raises(ValueError, match="lens_B"):
        decode_attention(q, k, v, lens.float(), 32, 1.0, impl="triton")
    with pytest.raises(ValueError, match="head dim must be contiguous"):
        decode_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, lens, 32, 1.0, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        decode_attention(q, k, v, lens, 32, 1.0, impl="bmm")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    q, k, v, lens = _case(2, 4, 2, 16, 3, 48, 40, torch.float32, device)
    for ns in (1, 3):
        torch.library.opcheck(torch.ops.prime_spmd.decode_attention, (q, k, v, lens, 40, 0.25, ns))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_replay_reads_new_lengths_and_cache():
    """Captured once; lengths and cache updated in place between replays, as the engine does."""
    q, k, v, lens = _case(4, 16, 8, 128, 4, 512, 384, torch.bfloat16, "cuda", seed=3)
    for ns in (0, 1, 4):
        decode_attention(q, k, v, lens, 384, 0.1, impl="triton", num_splits=ns)  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_attention(q, k, v, lens, 384, 0.1, impl="triton", num_splits=ns)
        for step in range(3):
            lens.copy_(torch.tensor([1 + step, 100, 383, 384 + step], device="cuda"))
            k.add_(0.1)
            graph.replay()
            ref = decode_attention(q, k, v, lens, 384, 0.1, impl="reference")
            assert _rel(out, ref) < BF16_RTOL
